"""How a node agent answers (issue 17): every call answers ``{"ok": value}`` or
``{"error": {"code", "message", "lost"}}`` rather than raising, so an error crosses the process boundary (a Ray
actor call) with its code intact: a sandbox agent's ``SandboxError``, a service agent's ``ServiceError``. The
transport builds the same error replies for its own failures (the agent or its node gone)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from reward_services.backend import ServiceError
from sandboxes.backend import SandboxError

Reply = dict[str, Any]


def ok(value: Any = None) -> Reply:
    return {"ok": value}


def failed(code: str, message: str, *, lost: bool = False) -> Reply:
    return {"error": {"code": code, "message": message, "lost": lost}}


def replying(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Reply]]:
    """An agent call answering ``ok(value)``, or ``failed`` with the code of the sandbox or service error it
    met."""

    @functools.wraps(method)
    async def call(self: Any, *args: Any) -> Reply:
        try:
            return ok(await method(self, *args))
        except SandboxError as error:
            return failed(error.code, error.message, lost=error.lost)
        except ServiceError as error:
            return failed(error.code, error.message)

    return call
