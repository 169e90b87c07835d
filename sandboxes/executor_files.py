"""The in-sandbox executor's file operations: its "write" and "read" ops (``sandboxes/executor.py`` dispatches them).

Why in the sandbox: the executor runs as the sandbox's user inside its container, so a path is resolved there, its
links included, with that user's rights: a link to /etc/passwd names the container's file, never the host's, and
nothing is written that the user could not write with a command. Every path must still resolve inside the working
directory (``root``): a link that leads out of it is refused, and a read takes only a regular file or a directory
(a FIFO would block the read, a device never end it). Both directions are bounded: a request by the executor's
frame limit, a read's answer by its ``limit``.

Shipped beside executor.py, like it stdlib only, for any python3 >= 3.8.

* write: {"op": "write", "root": DIR, "files": [{"path": P, "size": N, "mode": M?}], "dirs": [{"path": P,
  "mode": M?}], "payload": BYTES} makes the directories, then writes each file atomically (a temporary file renamed
  over it; an existing file keeps its mode unless one is given), its bytes the next ``size`` of the payload (the
  files' bytes one after another); answers {"ok": true, "files": N, "bytes": B}.
* read: {"op": "read", "root": DIR, "path": P, "limit": BYTES} answers {"ok": true, "type": "file", "payload":
  BYTES} for a regular file, or "type": "directory" with a tar of the directory (links stored as links, never
  followed), at most ``limit`` bytes either way.

The payload is bytes here: executor.py carries it raw after the frame's JSON (or base64 in once mode).

A refusal answers {"ok": false, "code": CODE, "error": MESSAGE}, the message starting with the path it is about.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
import tempfile

#: a new file's mode (an existing one keeps its own)
NEW_FILE_MODE = 0o644
NEW_DIR_MODE = 0o755


class FileOpError(Exception):
    """A file op refused: ``code`` says why (the broker maps it to an HTTP status), the message names the path."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def _kind(mode):
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "a device or other special file"


def _os_error(error, shown):
    if error.errno in (errno.ENOENT, errno.ENOTDIR):
        return FileOpError("file_not_found", f"{shown}: no such file or directory")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return FileOpError("file_denied", f"{shown}: the sandbox's user may not do that ({error.strerror})")
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return FileOpError("file_no_space", f"{shown}: the sandbox's disk is full ({error.strerror})")
    return FileOpError("file_io", f"{shown}: {error.strerror or error}")


def _root(request):
    root = request.get("root")
    if not isinstance(root, str) or not root.startswith("/"):
        raise FileOpError("file_bad_request", "root: must be an absolute path")
    real = os.path.realpath(root)
    if not os.path.isdir(real):
        raise FileOpError("file_not_found", f"{root}: the working directory does not exist")
    return real


def _relative(path, reading=False):
    """``path`` normalised, refused unless relative and inside the root ("." names the root itself, for a read)."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\x00" in path:
        raise FileOpError("file_bad_request", f"{path!r}: must be a relative path without NUL")
    normal = os.path.normpath(path)
    if normal == ".." or normal.startswith("../") or (normal == "." and not reading):
        raise FileOpError("file_outside", f"{path}: must name a path inside the working directory")
    return normal


def _resolved(root, relative, shown):
    """The real path of ``root/relative``, its links resolved here in the sandbox; refused unless inside root."""
    real = os.path.realpath(os.path.join(root, relative))
    if real != root and not real.startswith(root.rstrip("/") + "/"):
        raise FileOpError("file_outside", f"{shown}: resolves outside the working directory (a link leads out)")
    return real


def _mode(entry, shown):
    mode = entry.get("mode")
    if mode is not None and (not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777):
        raise FileOpError("file_bad_request", f"{shown}: mode must be an integer in [0, 0o7777]")
    return mode


def _directories(root, relative, shown, mode=None):
    """Each directory of ``relative`` made where missing, each resolved inside root before it is made or used;
    answers the last one's real path."""
    real = root
    parts = [] if relative in ("", ".") else relative.split("/")
    for i in range(1, len(parts) + 1):
        real = _resolved(root, "/".join(parts[:i]), shown)
        try:
            os.mkdir(real, NEW_DIR_MODE)
        except FileExistsError:
            info = os.stat(real)
            if not stat.S_ISDIR(info.st_mode):
                raise FileOpError("file_type", f"{shown}: {'/'.join(parts[:i])} is {_kind(info.st_mode)}, not a "
                                               f"directory") from None
    if mode is not None and parts:
        os.chmod(real, mode)
    return real


def _write_one(root, relative, data, mode, shown):
    _directories(root, os.path.dirname(relative), shown)
    target = _resolved(root, relative, shown)
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise FileOpError("file_type", f"{shown}: is {_kind(info.st_mode)}; only a regular file is replaced")
    if mode is None:
        mode = stat.S_IMODE(info.st_mode) if info is not None else NEW_FILE_MODE
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tangram-write-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _entries(request, key):
    entries = request.get(key, [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise FileOpError("file_bad_request", f"{key}: must be a list of objects")
    return entries


def write(request):
    """The "write" op: directories, then files, in the request's order."""
    root = _root(request)
    total = 0
    for entry in _entries(request, "dirs"):
        shown = entry.get("path")
        try:
            _directories(root, _relative(shown), shown, _mode(entry, shown))
        except OSError as error:
            raise _os_error(error, shown) from None
    files = _entries(request, "files")
    payload = request.get("payload", b"")
    sizes = [entry.get("size") for entry in files]
    if not isinstance(payload, (bytes, bytearray)) or not all(
            isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in sizes) \
            or sum(sizes) != len(payload):
        raise FileOpError("file_bad_request", "files: their sizes must be counts of bytes that add up to the payload")
    view = memoryview(payload)  # each file's bytes written from the payload, not copied out of it
    for entry, size in zip(files, sizes):
        shown = entry.get("path")
        relative = _relative(shown)
        mode = _mode(entry, shown)
        try:
            _write_one(root, relative, view[total:total + size], mode, shown)
        except OSError as error:
            raise _os_error(error, shown) from None
        total += size
    return {"ok": True, "files": len(files), "bytes": total}


class _Bounded:
    """A byte buffer that refuses to grow past ``limit``: what tarfile writes a tar into."""

    def __init__(self, limit, shown):
        self.buffer = bytearray()
        self.limit = limit
        self.shown = shown

    def tell(self):
        return len(self.buffer)

    def write(self, data):
        if len(self.buffer) + len(data) > self.limit:
            raise FileOpError("file_too_large", f"{self.shown}: its tar is more than the limit of {self.limit} bytes")
        self.buffer += data
        return len(data)


def _tar(real, limit, shown):
    out = _Bounded(limit, shown)
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(real, arcname=".", recursive=True)  # links are stored as links: tarfile follows none by default
    return out.buffer


def read(request):
    """The "read" op: a regular file's bytes, or a tar of a directory, within the request's limit."""
    root = _root(request)
    shown = request.get("path")
    limit = request.get("limit")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise FileOpError("file_bad_request", "limit: must be a count of bytes")
    real = _resolved(root, _relative(shown, reading=True), shown)
    try:
        info = os.lstat(real)
        if stat.S_ISDIR(info.st_mode):
            return {"ok": True, "type": "directory", "payload": _tar(real, limit, shown)}
        if not stat.S_ISREG(info.st_mode):
            raise FileOpError("file_type", f"{shown}: is {_kind(info.st_mode)}; only a regular file or a directory "
                                           f"is read")
        if info.st_size > limit:
            raise FileOpError("file_too_large", f"{shown}: holds {info.st_size} bytes, more than the limit of "
                                                f"{limit}")
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the lstat
                raise FileOpError("file_type", f"{shown}: changed while being read")
            chunks, size = [], 0
            while size <= limit:
                chunk = os.read(fd, min(limit + 1 - size, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as error:
        raise _os_error(error, shown) from None
    if size > limit:
        raise FileOpError("file_too_large", f"{shown}: holds more than the limit of {limit} bytes")
    return {"ok": True, "type": "file", "payload": b"".join(chunks)}


def handle(request):
    """One "write" or "read" request; a refusal becomes an answer, never an exception."""
    try:
        return write(request) if request.get("op") == "write" else read(request)
    except FileOpError as error:
        return {"ok": False, "code": error.code, "error": error.message}
