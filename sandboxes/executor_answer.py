"""What the broker takes from an executor's answer to a command.

The executor runs inside the sandbox, on the sandbox's own python3, so its answer is the sandbox's word: a sandbox
can make it say anything about its own command, but no more than the request allowed (``output_limit`` per
stream), with the types the broker expects. A frame larger than an honest executor could send for the request is
refused before it is read (``frame_limit``); the fields of a run answer are then checked and cut to the limit
(``bounded_run_answer``), so a lying executor cannot make the broker store or serve more than it asked for.
"""

from __future__ import annotations

from typing import Any

from sandboxes.executor import DEFAULT_OUTPUT_LIMIT

#: the largest answer an honest executor sends to anything but a run (ping, cpus) or for an empty run
FRAME_OVERHEAD_BYTES = 64 * 1024
#: JSON escapes a control byte as ``\\u00XX`` and an undecodable byte becomes U+FFFD: six bytes per byte at most
JSON_BYTES_PER_BYTE = 6
#: an executor's own error message (a bad field, a missing cwd) is kept to this many characters
MAX_ERROR_CHARS = 4096

_STREAMS = ("stdout", "stderr")
_INTEGERS = ("exit_code", "signal")
_FLAGS = ("timed_out", "oom_killed")


class BadAnswer(Exception):
    """An executor's answer that is not the shape of a run answer."""


def frame_limit(request: dict[str, Any]) -> int:
    """The largest frame an honest executor sends in answer to ``request``."""
    if request.get("op", "run") != "run":
        return FRAME_OVERHEAD_BYTES
    output_limit = request.get("output_limit", DEFAULT_OUTPUT_LIMIT)
    streams = len(_STREAMS) * JSON_BYTES_PER_BYTE * output_limit if isinstance(output_limit, int) else 0
    return FRAME_OVERHEAD_BYTES + streams


def _cut(text: str, limit: int) -> tuple[str, bool]:
    """``text`` within ``limit`` bytes of UTF-8, cut at a character boundary; and whether it was cut."""
    encoded = text.encode()
    if len(encoded) <= limit:
        return text, False
    return encoded[:limit].decode("utf-8", "ignore"), True


def _non_negative_int(answer: dict[str, Any], key: str) -> int:
    value = answer.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadAnswer(f"{key}: {value!r} is not a count of bytes")
    return value


def bounded_run_answer(answer: dict[str, Any], output_limit: int) -> dict[str, Any]:
    """The fields of a run answer the broker uses, type-checked, each stream at most ``output_limit`` bytes (cut
    and marked truncated when the executor sent more). Raises ``BadAnswer``."""
    bounded: dict[str, Any] = {}
    for key in _INTEGERS:
        value = answer.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadAnswer(f"{key}: {value!r} is not an integer")
        bounded[key] = value
    for key in _FLAGS:
        value = answer.get(key, False)
        if not isinstance(value, bool):
            raise BadAnswer(f"{key}: {value!r} is not a boolean")
        bounded[key] = value
    pid = answer.get("pid")  # a background run's
    if pid is not None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise BadAnswer(f"pid: {pid!r} is not a process id")
        bounded["pid"] = pid
    duration = answer.get("duration_s", 0.0)
    if not isinstance(duration, (int, float)) or isinstance(duration, bool) or not 0 <= duration < float("inf"):
        raise BadAnswer(f"duration_s: {duration!r} is not a duration")
    bounded["duration_s"] = float(duration)
    for stream in _STREAMS:
        text = answer.get(stream, "")
        if not isinstance(text, str):
            raise BadAnswer(f"{stream}: not a string")
        kept, cut = _cut(text, output_limit)
        truncated = answer.get(f"{stream}_truncated", False)
        if not isinstance(truncated, bool):
            raise BadAnswer(f"{stream}_truncated: {truncated!r} is not a boolean")
        size = _non_negative_int(answer, f"{stream}_bytes")
        bounded[stream] = kept
        bounded[f"{stream}_truncated"] = truncated or cut
        bounded[f"{stream}_bytes"] = max(size, len(kept.encode()))
    error = answer.get("error")
    if error is not None and not isinstance(error, str):
        raise BadAnswer(f"error: {error!r} is not a string")
    bounded["error"] = None if error is None else error[:MAX_ERROR_CHARS]
    return bounded
