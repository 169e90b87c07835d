"""One command for a sandbox's executor and its answer, as typed values, and their only translation to and from the
executor's JSON (the "run" op of ``sandboxes/executor.py``).

Why: the CPU manager, the sandbox backends and a node's agent pass these values, so only this module and the executor
know the wire's field names. The answer is the sandbox's word (the sandbox's own python3 runs the executor): decoding
it checks its types and cuts each stream to the request's ``output_limit``, so a lying executor cannot make the
broker store or serve more than it asked for (the frame itself is bounded before it is read:
``sandboxes/executor_answer.py``).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sandboxes.executor import DEFAULT_OUTPUT_LIMIT
from sandboxes.executor_answer import BadAnswer

#: an executor's own error message (a bad field, a missing cwd) is kept to this many characters
MAX_ERROR_CHARS = 4096


@dataclass(frozen=True)
class ExecRequest:
    """What the executor is asked to run, and how."""

    #: a shell string (run by ``/bin/sh -c``) or an argv
    command: str | tuple[str, ...]
    #: the cores it runs on, its whole process tree pinned there; empty: wherever the executor runs
    cores: tuple[int, ...] = ()
    #: added to the executor's environment
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    #: killed with its whole process tree past this; None: no deadline
    timeout_s: float | None = None
    #: bytes of each stream kept
    output_limit: int = DEFAULT_OUTPUT_LIMIT
    #: each process's address space (RLIMIT_AS), where no cgroup bounds the sandbox's memory (local processes)
    memory_bytes: int | None = None
    #: names the running command, for a re-pin onto other cores (the executor's "cpus" op)
    tag: str | None = None
    #: what the command leaves running is killed once it answers (in a container)
    reap: bool = False
    #: started and answered at once with its pid; it keeps running with the sandbox
    background: bool = False
    #: the elastic pytest runner shipped beside the executor goes on the command's PYTHONPATH
    pytest_runner: bool = False
    #: written to the command's standard input, then closed; None: /dev/null
    stdin: bytes | None = None
    #: who the command runs as: a uid, "UID:GID" or a user name in the sandbox; None: the executor's user
    user: int | str | None = None

    def protocol(self) -> int:
        """The executor protocol the request needs (``PROTOCOL_VERSION`` in ``executor.py``): an executor of an
        older one would ignore these fields, and run the command otherwise than asked."""
        newer = self.background or self.pytest_runner or self.stdin is not None or self.user is not None
        return 2 if newer else 1

    def to_wire(self) -> dict[str, Any]:
        """The executor's JSON request; fields at the executor's defaults are left out."""
        wire: dict[str, Any] = {"op": "run", "command": self.command if isinstance(self.command, str)
                                else list(self.command), "env": dict(self.env), "cwd": self.cwd,
                                "timeout_s": self.timeout_s, "output_limit": self.output_limit}
        if self.cores:
            wire["cpus"] = list(self.cores)
        if self.memory_bytes is not None:
            wire["memory_bytes"] = self.memory_bytes
        if self.tag is not None:
            wire["tag"] = self.tag
        for flag in ("reap", "background", "pytest_runner"):
            if getattr(self, flag):
                wire[flag] = True
        if self.stdin is not None:
            wire["stdin"] = base64.b64encode(self.stdin).decode("ascii")
        if self.user is not None:
            wire["user"] = self.user
        return wire


@dataclass(frozen=True)
class ExecResult:
    """What the executor answered about one command."""

    #: None when it did not exit by itself: a signal ended it, or it never started (``error``)
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    oom_killed: bool = False
    stdout: str = ""
    stderr: str = ""
    #: each stream's whole size, kept or not
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    #: why the executor could not run the command (a bad field, a missing cwd); None: it ran
    error: str | None = None
    #: a background command's process id, in the sandbox
    pid: int | None = None

    @classmethod
    def from_wire(cls, answer: Mapping[str, Any], output_limit: int) -> ExecResult:
        """The executor's JSON answer, type-checked, each stream at most ``output_limit`` bytes (cut at a character
        and marked truncated when the executor sent more); other fields are dropped. Raises ``BadAnswer``."""
        stdout, stdout_truncated, stdout_bytes = _stream(answer, "stdout", output_limit)
        stderr, stderr_truncated, stderr_bytes = _stream(answer, "stderr", output_limit)
        pid = _optional_int(answer, "pid")
        if pid is not None and pid <= 0:
            raise BadAnswer(f"pid: {pid!r} is not a process id")
        duration = answer.get("duration_s", 0.0)
        if not isinstance(duration, (int, float)) or isinstance(duration, bool) or not 0 <= duration < float("inf"):
            raise BadAnswer(f"duration_s: {duration!r} is not a duration")
        error = answer.get("error")
        if error is not None and not isinstance(error, str):
            raise BadAnswer(f"error: {error!r} is not a string")
        return cls(exit_code=_optional_int(answer, "exit_code"), signal=_optional_int(answer, "signal"),
                   timed_out=_flag(answer, "timed_out"), oom_killed=_flag(answer, "oom_killed"),
                   stdout=stdout, stderr=stderr, stdout_bytes=stdout_bytes, stderr_bytes=stderr_bytes,
                   stdout_truncated=stdout_truncated, stderr_truncated=stderr_truncated, duration_s=float(duration),
                   error=None if error is None else error[:MAX_ERROR_CHARS], pid=pid)


def _optional_int(answer: Mapping[str, Any], key: str) -> int | None:
    value = answer.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise BadAnswer(f"{key}: {value!r} is not an integer")
    return value


def _flag(answer: Mapping[str, Any], key: str) -> bool:
    value = answer.get(key, False)
    if not isinstance(value, bool):
        raise BadAnswer(f"{key}: {value!r} is not a boolean")
    return value


def _stream(answer: Mapping[str, Any], name: str, limit: int) -> tuple[str, bool, int]:
    """The stream's text within ``limit`` bytes of UTF-8, whether it was cut (by the executor or here), and its
    size in bytes (never fewer than those kept)."""
    text = answer.get(name, "")
    if not isinstance(text, str):
        raise BadAnswer(f"{name}: not a string")
    truncated = _flag(answer, f"{name}_truncated")
    size = answer.get(f"{name}_bytes", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadAnswer(f"{name}_bytes: {size!r} is not a count of bytes")
    kept = len(encoded := text.encode())
    if kept > limit:
        text, truncated = encoded[:limit].decode("utf-8", "ignore"), True
        kept = len(text.encode())
    return text, truncated, max(size, kept)
