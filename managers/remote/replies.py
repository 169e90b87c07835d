"""How a node agent answers (issue 17): every call answers ``{"ok": value}`` or
``{"error": {"code", "message", "lost"}}`` rather than raising, so an error crosses the process boundary (a Ray
actor call) with its code intact: a sandbox agent's ``SandboxError``, a service agent's ``ServiceError``. The
transport builds the same error replies for its own failures (the agent or its node gone).

And how an agent is fenced (issue 35): the broker calls every method through the agent's ``FencedAgent.call`` with
its leader's epoch (``fenced``), and the agent refuses an epoch below the highest it has seen, answering
``deposed`` before the method runs; the broker that gets that answer stops as when its store refuses a write
(``tangram/core/fencing.py``). A node agent keeps that epoch in a file on its node, so that Ray restarting it
does not open the gate again."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from reward_services.backend import ServiceError
from sandboxes.backend import SandboxError
from tangram.core.fencing import DEPOSED, current

Reply = dict[str, Any]

log = logging.getLogger("tangram.agents")


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
    """An agent that only the newest leader drives. Where it keeps the highest epoch on its node too
    (``remember_epochs_in``), an agent Ray restarted starts again from that; otherwise from no epoch, taking the next
    caller's."""

    #: the highest epoch a broker called with (0: none yet)
    _epoch = 0
    #: the file on the agent's node that keeps ``_epoch`` across restarts of the agent (None: kept in memory only)
    _epoch_file: Path | None = None

    def remember_epochs_in(self, path: Path) -> None:
        """Keep the highest epoch in ``path`` (a directory only root writes: the node's run directory), and start
        from the one kept there, if any."""
        self._epoch_file = path
        try:
            self._epoch = max(self._epoch, int(path.read_text()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as error:  # unreadable: no epoch to start from, as without the file
            log.warning("agent epoch file %s unreadable (%s): starting from no epoch", path, error)

    async def call(self, epoch: int | None, method: str, *args: Any) -> Reply:
        """``method(*args)``, unless a broker of a later epoch than ``epoch`` has called already (then
        ``deposed``); ``epoch`` None or 0: a broker that was not elected, which no epoch fences."""
        if epoch:
            if epoch < self._epoch:
                return failed(DEPOSED, f"the agent was called by the leader of epoch {self._epoch}; epoch {epoch} "
                                       f"no longer leads")
            if epoch > self._epoch:
                self._epoch = epoch
                self._save_epoch()
        reply: Reply = await getattr(self, method)(*args)
        return reply

    def _save_epoch(self) -> None:
        """Write the epoch to its file, replaced whole (a restart reads an old epoch or the new one, never part)."""
        if self._epoch_file is None:
            return
        written = self._epoch_file.with_name(self._epoch_file.name + ".new")
        try:
            self._epoch_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            written.write_text(str(self._epoch))
            os.replace(written, self._epoch_file)
        except OSError as error:  # the gate still holds in memory; only a restart would forget it
            log.warning("agent epoch %d not kept in %s: %s", self._epoch, self._epoch_file, error)


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
