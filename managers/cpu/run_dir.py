"""The fast path's run directory is the broker's: it connects, as root, to the executor sockets there and bind-mounts
the sandboxes' directories from it, so no other user may write in it or in any directory above it (one who could
would swap a directory or a socket under the broker). Checked at start, before anything in it is read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sandboxes.backend import SandboxError

#: the code of the start-up error
UNSAFE_RUN_DIR = "run_dir_unsafe"


def trusted_run_dir(path: Path) -> None:
    """Check the directories above ``path`` that exist, make what is missing of it (``path`` itself 0700), then
    check it and every directory above it (links resolved): owned by root or this process's user, writable by
    nobody else, except that a directory above it may be a sticky one such as /tmp. Raises ``SandboxError`` naming
    the directory and the fix."""
    nearest = next(directory for directory in (path, *path.parents) if directory.exists())
    _check_chain(nearest.resolve(), path, sticky_ok=nearest != path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_chain(path.resolve(), path, sticky_ok=False)


def _check_chain(real: Path, path: Path, *, sticky_ok: bool) -> None:
    """``real`` and every directory above it; ``sticky_ok``: ``real`` itself lies above the run directory."""
    for directory in (real, *real.parents):
        info = os.stat(directory)
        if info.st_uid not in (0, os.geteuid()):
            raise SandboxError(UNSAFE_RUN_DIR, f"cpu.run_dir: {directory} (on the way to {path}) belongs to uid "
                                               f"{info.st_uid}, neither root nor this broker's user: that user could "
                                               f"replace what the broker trusts there. `chown root {directory}` or "
                                               f"choose another run_dir")
        sticky = info.st_mode & stat.S_ISVTX and (directory != real or sticky_ok)
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
            raise SandboxError(UNSAFE_RUN_DIR, f"cpu.run_dir: {directory} (on the way to {path}) is writable by "
                                               f"its group or others (mode {stat.filemode(info.st_mode)}): they "
                                               f"could replace what the broker trusts there. `chmod go-w "
                                               f"{directory}` or choose another run_dir")
