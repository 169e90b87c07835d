"""The wire of the direct channel between a broker and a node agent on the same host (issue 40).

A Ray actor call costs a few milliseconds on a busy host, most of an exec's time through an agent; a unix socket round
trip costs a tenth of one. Where the broker shares its host with the agent (the agent says where its socket is, and
the broker can connect to it), the calls go over that socket instead of Ray.

The wire: the client first sends the agent's token (``TOKEN_BYTES`` random bytes the agent handed the broker through
Ray, which authenticated it), which the agent acknowledges with ``ACCEPTED`` or answers by closing; then requests,
one at a time per connection, each answered before the next. A frame is its length (8 bytes, big-endian) and a
pickle: a request ``(epoch, method, args)``, an answer the agent's ``Reply``. Nothing is unpickled before the token
has matched, and a frame longer than its reader's bound is refused before it is read: the two ends are then the broker
and its agent, which Ray's own calls trust with pickles alike.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from pathlib import Path
from typing import Any

#: the length of the agent's token, the first thing a client sends
TOKEN_BYTES = 32
#: the agent's answer to the right token
ACCEPTED = b"\x01"
#: what a frame may carry past the payloads its reader bounds (paths, environment, the pickle's own bytes)
FRAME_SLACK_BYTES = 4 << 20
_LENGTH = struct.Struct(">Q")


class FrameTooLarge(Exception):
    """A frame longer than its reader's bound: the connection is closed unread."""


def frame(value: Any) -> bytes:
    """``value`` as one frame."""
    body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, limit: int) -> Any:
    """The next frame's value; ``FrameTooLarge`` past ``limit`` bytes, ``IncompleteReadError`` at the end."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > limit:
        raise FrameTooLarge(f"a frame of {length} bytes; the bound is {limit}")
    return pickle.loads(await reader.readexactly(length))


def host_identity() -> str:
    """This host's kernel, as its boot id: an agent reporting another one runs elsewhere, and a broker does not try
    its socket. The same id does not promise the same filesystem (two containers of one host): connecting decides."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
