"""The output of the ``exec`` actions running now, for ``GET /v1/actions/{id}/output`` to stream while they run.

Why a buffer per action rather than a queue per reader: readers come and go (a client reconnects, two watch one
action), and each must see the output from its start. The buffer is bounded like the action's record (at most
``output_limit`` bytes per stream, the bytes the record keeps) and lives exactly as long as the command: the manager
opens it before the command starts and closes it when the command's answer is in. A reader holds no task and no
buffer of its own, so a client that drops its stream costs nothing and cancels nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

STREAMS = ("stdout", "stderr")
#: the arrival order of stdout and stderr is kept for this many alternations; later output still streams whole, each
#: stream's in its own order (a command interleaving tiny writes must not grow the buffer past its bytes)
MAX_SWITCHES = 4096


class LiveOutput:
    """One running command's output so far: each stream's first ``limit`` bytes, in the order they came."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = {name: bytearray() for name in STREAMS}
        #: (stream, its size then): where the output switched from one stream to the other
        self._order: list[tuple[str, int]] = []
        self.ended = False
        self._changed = asyncio.Event()
        #: readers following it now
        self.readers = 0

    def __call__(self, stream: str, data: bytes) -> None:
        """The sandbox's output sink: ``add``."""
        self.add(stream, data)

    @property
    def watched(self) -> bool:
        """Whether anyone reads it now: output that costs calls to fetch (a node agent's) is fetched only then."""
        return self.readers > 0

    def add(self, stream: str, data: bytes) -> None:
        """A piece of ``stream`` as the sandbox read it; what passes the limit is dropped."""
        kept = self.data[stream]
        piece = data[:self.limit - len(kept)]
        if not piece:
            return
        kept += piece
        if self._order and self._order[-1][0] == stream:
            self._order[-1] = (stream, len(kept))
        elif len(self._order) < MAX_SWITCHES:
            self._order.append((stream, len(kept)))
        self._wake()

    def end(self) -> None:
        """The command answered: readers get what is left, then stop."""
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self) -> AsyncIterator[tuple[str, bytes]]:
        """(stream, bytes) from the start until the command ends, each byte once."""
        self.readers += 1
        try:
            async for piece in self._pieces():
                yield piece
        finally:
            self.readers -= 1

    async def _pieces(self) -> AsyncIterator[tuple[str, bytes]]:
        sent = dict.fromkeys(STREAMS, 0)
        at = 0
        while True:
            changed = self._changed
            while at < len(self._order):
                stream, size = self._order[at]
                if size > sent[stream]:
                    piece, sent[stream] = bytes(self.data[stream][sent[stream]:size]), size
                    yield stream, piece
                elif at + 1 < len(self._order):
                    at += 1
                else:
                    break  # the last switch may still grow
            for stream in STREAMS:  # past MAX_SWITCHES, or grown since the last one: in each stream's order
                if len(self.data[stream]) > sent[stream]:
                    piece, sent[stream] = bytes(self.data[stream][sent[stream]:]), len(self.data[stream])
                    yield stream, piece
            if self.ended and all(len(self.data[name]) == sent[name] for name in STREAMS):
                return
            await changed.wait()


class LiveOutputs:
    """The live output of each running ``exec`` action, by action id, and the readers waiting for one to start."""

    def __init__(self) -> None:
        self._live: dict[str, LiveOutput] = {}
        self._waiting: dict[str, set[asyncio.Future[LiveOutput]]] = {}

    def open(self, action_id: str, limit: int) -> LiveOutput:
        """The action's command starts now: its buffer, handed to those waiting for it."""
        live = self._live[action_id] = LiveOutput(limit)
        for waiter in self._waiting.pop(action_id, ()):
            if not waiter.done():
                waiter.set_result(live)
        return live

    def close(self, action_id: str) -> None:
        """The action's command answered: its buffer ends, and goes once its readers are done with it."""
        live = self._live.pop(action_id, None)
        if live is not None:
            live.end()

    def get(self, action_id: str) -> LiveOutput | None:
        return self._live.get(action_id)

    async def started(self, action_id: str) -> LiveOutput:
        """The action's buffer once its command starts (at once if it runs); a cancelled wait leaves nothing."""
        live = self._live.get(action_id)
        if live is not None:
            return live
        waiter: asyncio.Future[LiveOutput] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(action_id, set())
        waiters.add(waiter)
        try:
            return await waiter
        finally:
            waiters.discard(waiter)
            if not waiters and self._waiting.get(action_id) is waiters:
                del self._waiting[action_id]
