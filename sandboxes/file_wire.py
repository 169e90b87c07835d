"""The executor's file ops ("write" and "read", ``sandboxes/executor_files.py``) as typed values, and their only
translation to and from its JSON; ``sandboxes/exec_wire.py`` is the same for a command.

Why: the CPU manager, the sandbox backends and a node's agent pass these values, so only this module and the executor
know the wire's field names. A read's answer is the sandbox's word: it is checked against the request's limit as it is
decoded (its frame was bounded before it was read: ``sandboxes/executor_answer.py``). File bytes are the wire's
"payload", raw after the frame on the executor's socket (``sandboxes/executor_client.py``): a write's files one after
another, their sizes in the JSON, and a read's file; the one-shot mode carries them base64 instead.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pybase64

from sandboxes.executor import UNKNOWN_OP
from sandboxes.executor_answer import BadAnswer

T_co = TypeVar("T_co", covariant=True)
#: the executor's message about a refusal is kept to this many characters
MAX_MESSAGE_CHARS = 4096


class FileRefused(Exception):
    """The executor refused a file op: ``code`` (``file_not_found``, ``file_outside``, ``file_type``,
    ``file_too_large``, ``file_denied``, ``file_no_space``, ``file_io``, ``file_bad_request``, or
    ``executor_too_old`` for an executor that predates the ops) and a message naming the path."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class FileOp(Protocol[T_co]):
    """One file op: its request for a sandbox whose working directory is ``root``, and its answer decoded."""

    def to_wire(self, root: str) -> dict[str, Any]: ...

    def answer(self, wire: Mapping[str, Any]) -> T_co: ...


@dataclass(frozen=True)
class Written:
    files: int
    bytes: int


@dataclass(frozen=True)
class WriteFiles:
    """Files to write (normalised relative paths: ``managers/cpu/exec_spec.py`` checked them), after the
    directories to make; a mode given (from a tar) is set, else an existing file keeps its own."""

    files: Mapping[str, bytes]
    modes: Mapping[str, int] = field(default_factory=dict)
    dirs: Mapping[str, int | None] = field(default_factory=dict)

    def to_wire(self, root: str) -> dict[str, Any]:
        return {"op": "write", "root": root,
                "dirs": [{"path": path, "mode": mode} for path, mode in self.dirs.items()],
                "files": [{"path": path, "size": len(data), "mode": self.modes.get(path)}
                          for path, data in self.files.items()],
                "payload": b"".join(self.files.values())}  # one file's bytes are not copied: join returns them

    def answer(self, wire: Mapping[str, Any]) -> Written:
        _refused(wire)
        files, size = wire.get("files"), wire.get("bytes")
        if not (isinstance(files, int) and isinstance(size, int)):
            raise BadAnswer(f"a write answered {files!r} files of {size!r} bytes")
        return Written(files, size)


@dataclass(frozen=True)
class FileData:
    """A read's answer: a regular file's bytes, or (``directory``) a tar of the directory."""

    directory: bool
    data: bytes


@dataclass(frozen=True)
class ReadFile:
    """The file or directory at ``path`` (relative; "." is the working directory), at most ``limit`` bytes."""

    path: str
    limit: int

    def to_wire(self, root: str) -> dict[str, Any]:
        return {"op": "read", "root": root, "path": self.path, "limit": self.limit}

    def answer(self, wire: Mapping[str, Any]) -> FileData:
        _refused(wire)
        kind, payload = wire.get("type"), wire.get("payload")
        if kind not in ("file", "directory") or not isinstance(payload, (bytes, str)):
            raise BadAnswer(f"a read answered type {kind!r} with a payload of type {type(payload).__name__}")
        try:
            data = payload if isinstance(payload, bytes) else pybase64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BadAnswer("a read answered a payload that is not base64") from None
        if len(data) > self.limit:
            raise BadAnswer(f"a read answered {len(data)} bytes, more than its limit of {self.limit}")
        return FileData(kind == "directory", data)


def _refused(wire: Mapping[str, Any]) -> None:
    """Raise the executor's refusal, if it refused."""
    if wire.get("ok") is True:
        return
    error = wire.get("error")
    if isinstance(error, str) and error.startswith(UNKNOWN_OP):
        raise FileRefused("executor_too_old", "the sandbox's executor predates file ops (a sandbox adopted from an "
                                              "older broker): write and read files with a command")
    code = wire.get("code")
    if not (isinstance(code, str) and code.startswith("file_") and isinstance(error, str)):
        raise BadAnswer(f"a file op answered neither ok nor a refusal: code {code!r}")
    raise FileRefused(code, error[:MAX_MESSAGE_CHARS])
