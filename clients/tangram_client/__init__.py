"""Python clients of the ARL-Tangram broker: ``AsyncTangramClient`` (aiohttp) and its blocking twin
``TangramClient``, with typed records and errors. The verl tool plugin and reward adapter live beside them.

A distribution of its own (``arl-tangram-client``, ``clients/pyproject.toml``): it needs aiohttp and orjson, runs on
Python >= 3.10 and imports nothing of the broker's packages."""

from tangram_client.client import AsyncTangramClient, unit_demand
from tangram_client.errors import (
    ActionError,
    ApiError,
    BadRequestError,
    BrokerUnreachable,
    ConflictError,
    ForbiddenError,
    NotFoundError,
    OverloadedError,
    TangramError,
    TooLargeError,
    UnauthorizedError,
    UnprocessableError,
    WaitTimeout,
)
from tangram_client.output_stream import OutputPiece
from tangram_client.records import ActionRecord
from tangram_client.sync_client import TangramClient

__all__ = ["ActionError", "ActionRecord", "ApiError", "AsyncTangramClient", "BadRequestError", "BrokerUnreachable",
           "ConflictError", "ForbiddenError", "NotFoundError", "OutputPiece", "OverloadedError", "TangramClient",
           "TangramError", "TooLargeError", "UnauthorizedError", "UnprocessableError", "WaitTimeout", "unit_demand"]
