"""Turns in one environment: its commands run side by side, a file op runs alone, all in arrival order.

Why: a file op (``managers/cpu/environment_files.py``) is no action, as it holds no resource for the scheduler to
decide about, yet it is ordered with its trajectory's commands: a write that arrives while a command runs waits for it
to end, and a command that arrives while a file op waits or runs starts after it. No command sees a half-written
tree, and a file op does not starve behind a stream of overlapping commands.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Turns:
    """A fair reader-writer lock: commands share it, a file op holds it alone; first come, first served."""

    def __init__(self) -> None:
        self._commands = 0
        self._alone = False
        self._waiting: deque[tuple[bool, asyncio.Future[None]]] = deque()

    @asynccontextmanager
    async def command(self) -> AsyncIterator[None]:
        """A command's turn: after every file op that came before it."""
        await self._enter(alone=False)
        try:
            yield
        finally:
            self._leave(alone=False)

    @asynccontextmanager
    async def alone(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """A file op's turn: once the commands and file ops that came before it have ended; TimeoutError when that
        takes more than ``wait_s`` (None: no bound)."""
        async with asyncio.timeout(wait_s):
            await self._enter(alone=True)
        try:
            yield
        finally:
            self._leave(alone=True)

    @property
    def busy(self) -> bool:
        """Whether a command or file op holds a turn or waits for one."""
        return self._alone or self._commands > 0 or bool(self._waiting)

    def _free_for(self, alone: bool) -> bool:
        return not self._alone and (not alone or self._commands == 0)

    def _take(self, alone: bool) -> None:
        if alone:
            self._alone = True
        else:
            self._commands += 1

    async def _enter(self, alone: bool) -> None:
        if not self._waiting and self._free_for(alone):
            self._take(alone)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (alone, turn)
        self._waiting.append(entry)
        try:
            await turn
        except BaseException:  # cancelled while waiting, or just as its turn came
            if turn.done() and not turn.cancelled():
                self._leave(alone)
            else:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                self._wake()
            raise

    def _leave(self, alone: bool) -> None:
        if alone:
            self._alone = False
        else:
            self._commands -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiting:
            alone, turn = self._waiting[0]
            if turn.done():  # cancelled, its waiter not told yet: it gets no turn
                self._waiting.popleft()
                continue
            if not self._free_for(alone):
                return
            self._waiting.popleft()
            self._take(alone)
            turn.set_result(None)
