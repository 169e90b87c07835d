"""Opening what a sandbox can write, without trusting it.

The executor's socket directory is shared with the sandbox, so whatever sits there may have been put there by the
sandbox: a symbolic link to a host socket or to another tenant's executor (``/proc/<pid>/root/...``), a FIFO that
blocks whoever opens it, a file of any size. These helpers never follow a link in the last path component, check
the type of what they opened, and bound what they read. The directories above it are the broker's own.
"""

from __future__ import annotations

import errno
import os
import stat


class UntrustedPath(Exception):
    """What is at the path is not what the broker expects there (a link, another file type, too large)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "a device or other special file"


def open_socket(path: str) -> int:
    """An ``O_PATH`` descriptor of the unix socket at ``path`` (itself, never a link's target); connect through
    ``via_descriptor(fd)`` and close it after. Raises ``UntrustedPath``, or OSError when nothing is there."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISSOCK(mode):
        os.close(fd)
        raise UntrustedPath(f"{path} is {_kind(mode)}, not a socket")
    return fd


def via_descriptor(fd: int) -> str:
    """The address that reaches the socket ``fd`` holds: connecting there opens that inode, not a path again."""
    return f"/proc/self/fd/{fd}"


def read_regular(path: str, limit: int) -> bytes:
    """The contents of the regular file at ``path``, at most ``limit`` bytes; a link, a FIFO (opened without
    blocking) or a larger file raises ``UntrustedPath``. Blocking I/O: call it off the event loop."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UntrustedPath(f"{path} is a symbolic link, not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedPath(f"{path} is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise UntrustedPath(f"{path} holds {info.st_size} bytes, more than {limit}")
        data = os.read(fd, limit + 1)
        if len(data) > limit:  # grew since fstat
            raise UntrustedPath(f"{path} holds more than {limit} bytes")
        return data
    finally:
        os.close(fd)
