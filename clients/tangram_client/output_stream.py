"""An ``exec`` action's output stream as the client reads it (``GET /v1/actions/{id}/output``, server-sent events).

Why its own parser rather than reading lines: one event's ``data:`` line can carry a whole stored stream (up to the
action's ``output_limit``, escaped), past what a line reader buffers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class OutputPiece:
    """One event: the next ``text`` of ``stdout`` or ``stderr``, or the stream's ``end`` with the action's
    ``state``, ``exit_code`` and ``error`` (its code and message, or None)."""

    event: str
    text: str = ""
    end: dict[str, Any] | None = None


def _piece(block: bytes) -> OutputPiece | None:
    """The event a block of lines spells, or None for a comment (``: waiting``) or an event this client does not
    know."""
    event, data = "", b""
    for line in block.split(b"\n"):
        if line.startswith(b"event: "):
            event = line[len(b"event: "):].decode()
        elif line.startswith(b"data: "):
            data = line[len(b"data: "):]
    if event in ("stdout", "stderr"):
        return OutputPiece(event, orjson.loads(data)["data"])
    if event == "end":
        return OutputPiece(event, end=orjson.loads(data))
    return None


async def read_pieces(chunks: AsyncIterator[bytes]) -> AsyncIterator[OutputPiece]:
    """The events in a response body's chunks, up to and including ``end``."""
    buffer = bytearray()
    async for chunk in chunks:
        looked = max(0, len(buffer) - 1)  # a long event arrives in many chunks: each byte is searched once
        buffer += chunk
        while (cut := buffer.find(b"\n\n", looked)) >= 0:
            piece = _piece(bytes(buffer[:cut]))
            del buffer[:cut + 2]
            looked = 0
            if piece is not None:
                yield piece
                if piece.event == "end":
                    return
