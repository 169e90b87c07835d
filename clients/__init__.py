"""Python clients of the ARL-Tangram broker: ``AsyncTangramClient`` (aiohttp) and its blocking twin
``TangramClient``, with typed records and errors. The verl tool plugin and reward adapter live beside them."""

from clients.client import AsyncTangramClient, unit_demand
from clients.errors import (
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
from clients.output_stream import OutputPiece
from clients.records import ActionRecord
from clients.sync_client import TangramClient

__all__ = ["ActionError", "ActionRecord", "ApiError", "AsyncTangramClient", "BadRequestError", "BrokerUnreachable",
           "ConflictError", "ForbiddenError", "NotFoundError", "OutputPiece", "OverloadedError", "TangramClient",
           "TangramError", "TooLargeError", "UnauthorizedError", "UnprocessableError", "WaitTimeout", "unit_demand"]
