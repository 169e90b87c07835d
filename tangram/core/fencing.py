"""A leader's fence beyond its store (issue 35): what this broker sends to node agents, sandboxes and upstreams stops
once it may no longer lead.

The store fences itself (``tangram/leadership.py``): a deposed leader's write is refused. Node agents fence the
same way: every call carries the caller's epoch and an agent refuses an epoch below the highest it has seen
(``managers/remote/replies.py``), so a new leader's first calls (adoption, at its start) shut the old one out of
every agent it reaches; the refusal deposes the old one. Sandboxes without an agent and upstream APIs cannot
compare epochs, so the broker calls ``Fencing.check`` right before each such side effect (a command, a new
sandbox, an HTTP attempt; a deposed broker removes no sandbox): it fails once anything told this broker it was
deposed (the store's fence refused a write, the lock's check failed, an agent refused its epoch), and the service
stops the broker at once.

The window that remains for those is the time between a new leader taking the lock and the old one learning that
it lost it: at most ``POLL_S`` once the database has ended the old leader's session, and at most ``POLL_S`` plus
``CHECK_TIMEOUT_S`` when the database goes silent instead (unless a store write or an agent call tells it sooner).
At an agent, what remains is a call it accepted before the new leader's first one, and the agents a new leader
never calls (each broker makes its own service agents on GPU nodes): those are bounded by the window above. A node
agent that Ray restarts starts from the epoch it kept on its node (``managers/remote/replies.py``).

One ``Fencing`` per leading broker, installed for the process by ``leading`` while it runs; outside that (a single
broker on SQLite, a test's broker) the current fencing has no epoch and is never deposed: nothing is fenced.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tangram.core.errors import ActionFailed

#: the error code of a call refused because its broker no longer leads
DEPOSED = "deposed"


class Fencing:
    """One broker's standing as leader, read before what it sends beyond its store."""

    def __init__(self, epoch: int | None = None) -> None:
        #: the leader's epoch, sent with every agent call (None: not elected, nothing to fence)
        self.epoch = epoch
        #: why this broker no longer leads, once it knows
        self.deposed_by: str | None = None
        #: set with ``deposed_by``: the service stops the broker at once
        self.deposed = asyncio.Event()

    def depose(self, reason: str) -> None:
        """Note that this broker no longer leads (the first reason is kept)."""
        if self.deposed_by is None:
            self.deposed_by = reason
            self.deposed.set()

    def check(self) -> None:
        """Raise ``ActionFailed("deposed")`` once deposed: called right before a side effect beyond the store."""
        if self.deposed_by is not None:
            raise ActionFailed(DEPOSED, f"this broker no longer leads: {self.deposed_by}")


_current = Fencing()


def current() -> Fencing:
    """The fencing of the broker this process runs (one without an epoch when it was not elected)."""
    return _current


@asynccontextmanager
async def leading(fencing: Fencing) -> AsyncIterator[Fencing]:
    """Install ``fencing`` as this process's while the block runs (an async context, to enter beside the broker's)."""
    global _current
    previous, _current = _current, fencing
    try:
        yield fencing
    finally:
        _current = previous
