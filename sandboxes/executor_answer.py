"""How large an executor's answer may be before the broker reads it.

The executor runs inside the sandbox, on the sandbox's own python3, so its answer is the sandbox's word: a sandbox
can make it say anything about its own command, but no more than the request allowed (``output_limit`` per
stream). A frame larger than an honest executor could send for the request is refused before it is read
(``frame_limit``); a run answer's fields are then checked and cut to the limit as it is decoded
(``ExecResult.from_wire`` in ``sandboxes/exec_wire.py``). A read's bytes follow its frame raw on the socket
(``payload_limit`` bounds them), or come base64 inside the frame from the one-shot mode (``frame_limit`` allows
for that).
"""

from __future__ import annotations

from typing import Any

from sandboxes.executor import DEFAULT_OUTPUT_LIMIT

#: the largest answer an honest executor sends to anything but a run (ping, cpus) or for an empty run
FRAME_OVERHEAD_BYTES = 64 * 1024
#: JSON escapes a control byte as ``\\u00XX`` and an undecodable byte becomes U+FFFD: six bytes per byte at most
JSON_BYTES_PER_BYTE = 6
_STREAMS = ("stdout", "stderr")


class BadAnswer(Exception):
    """An executor's answer that is not the shape of an answer to its request."""


def frame_limit(request: dict[str, Any]) -> int:
    """The largest frame an honest executor sends in answer to ``request`` (the executor's JSON, of any op)."""
    op = request.get("op", "run")
    if op == "read":  # in once mode, the file or tar base64-encoded in the JSON, at most the request's limit
        limit = request.get("limit", 0)
        return FRAME_OVERHEAD_BYTES + (4 * -(-limit // 3) if isinstance(limit, int) else 0)
    if op != "run":
        return FRAME_OVERHEAD_BYTES
    output_limit = request.get("output_limit", DEFAULT_OUTPUT_LIMIT)
    streams = len(_STREAMS) * JSON_BYTES_PER_BYTE * output_limit if isinstance(output_limit, int) else 0
    return FRAME_OVERHEAD_BYTES + streams


def payload_limit(request: dict[str, Any]) -> int:
    """The most raw bytes an honest executor sends after its frame in answer to ``request``: a read's limit."""
    limit = request.get("limit", 0) if request.get("op") == "read" else 0
    return limit if isinstance(limit, int) else 0
