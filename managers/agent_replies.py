"""How a node agent answers (issue 17): every call answers ``{"ok": value}`` or
``{"error": {"code", "message", "lost"}}`` rather than raising, so an error crosses the process boundary (a Ray
actor call) with its code intact: a sandbox agent's ``SandboxError``, a service agent's ``ServiceError``. The
transport builds the same error replies for its own failures (the agent or its node gone).

And how an agent is fenced (issue 35): the broker calls every method through the agent's ``FencedAgent.call`` with
its leader's epoch (``fenced``), and the agent refuses an epoch below the highest it has seen, answering
``deposed`` before the method runs; the broker that gets that answer stops as when its store refuses a write
(``tangram/core/fencing.py``)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from reward_services.backend import ServiceError
from sandboxes.backend import SandboxError
from tangram.core.fencing import DEPOSED, current

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


class FencedAgent:
    """An agent that only the newest leader drives: an agent Ray restarted starts again from no epoch, and takes the
    next caller's."""

    #: the highest epoch a broker called with (0: none yet)
    _epoch = 0

    async def call(self, epoch: int | None, method: str, *args: Any) -> Reply:
        """``method(*args)``, unless a broker of a later epoch than ``epoch`` has called already (then
        ``deposed``); ``epoch`` None or 0: a broker that was not elected, which no epoch fences."""
        if epoch:
            if epoch < self._epoch:
                return failed(DEPOSED, f"the agent was called by the leader of epoch {self._epoch}; epoch {epoch} "
                                       f"no longer leads")
            self._epoch = epoch
        reply: Reply = await getattr(self, method)(*args)
        return reply


async def fenced(agent: str, send: Callable[[int | None], Awaitable[Reply]]) -> Reply:
    """One call to an agent as this broker's leadership allows: none once it is deposed, else ``send(epoch)``
    (which calls the agent's ``FencedAgent.call``); the agent's refusal deposes this broker. ``agent`` names it."""
    fencing = current()
    if fencing.deposed_by is not None:
        return failed(DEPOSED, f"this broker no longer leads: {fencing.deposed_by}")
    reply = await send(fencing.epoch)
    error = reply.get("error")
    if error is not None and error["code"] == DEPOSED:
        fencing.depose(f"{agent} refused this broker's call: {error['message']}")
    return reply
