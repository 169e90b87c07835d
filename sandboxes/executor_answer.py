"""How large an executor's answer may be before the broker reads it.

The executor runs inside the sandbox, on the sandbox's own python3, so its answer is the sandbox's word: a sandbox
can make it say anything about its own command, but no more than the request allowed (``output_limit`` per
stream). A frame larger than an honest executor could send for the request is refused before it is read
(``frame_limit``); a run answer's fields are then checked and cut to the limit as it is decoded
(``ExecResult.from_wire`` in ``sandboxes/exec_wire.py``).
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
    if op == "read":  # the file or tar, base64-encoded, at most the request's limit
        limit = request.get("limit", 0)
        return FRAME_OVERHEAD_BYTES + (4 * -(-limit // 3) if isinstance(limit, int) else 0)
    if op != "run":
        return FRAME_OVERHEAD_BYTES
    output_limit = request.get("output_limit", DEFAULT_OUTPUT_LIMIT)
    streams = len(_STREAMS) * JSON_BYTES_PER_BYTE * output_limit if isinstance(output_limit, int) else 0
    return FRAME_OVERHEAD_BYTES + streams
