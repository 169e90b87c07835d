"""What a test process does to itself before the solution under test may run beside it (same sandbox, same uid).

``make_undumpable``: a process of the same uid can read and write another's memory and take over its descriptors
through ``/proc/<pid>/mem``, ``/proc/<pid>/fd`` and ``ptrace``, unless the target is not dumpable; then only a
holder of CAP_SYS_PTRACE can (sandboxes drop every capability). ``strip_writable_paths``: once the solution runs it
can write files, so any later import from a directory it can write would load its code into the test process; the
modules a test needs are imported by then, and the rest come from directories it cannot write.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable

_PR_SET_DUMPABLE, _PR_GET_DUMPABLE = 4, 3


class GuardError(RuntimeError):
    """The process cannot protect itself; the solution must not run beside it."""


def make_undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0) for this process (Linux): what it holds (a report key, the tests' verdicts) can no
    longer be read or changed through /proc or ptrace by another process of its uid without CAP_SYS_PTRACE. Children
    it forks inherit it until they exec. Raises GuardError where the kernel refuses or there is no prctl."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.prctl(_PR_SET_DUMPABLE, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
                            ctypes.c_ulong(0)) != 0
    except (OSError, AttributeError) as error:
        raise GuardError(f"cannot make the test process undumpable: {error}") from None
    if failed:
        raise GuardError(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(ctypes.get_errno())}")


def is_dumpable() -> bool:
    """prctl(PR_GET_DUMPABLE) for this process."""
    return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_DUMPABLE, ctypes.c_ulong(0), ctypes.c_ulong(0),
                                                        ctypes.c_ulong(0), ctypes.c_ulong(0)))


def _inside(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _writable(path: str) -> bool:
    """Whether this uid can write ``path`` or any directory above it (and so replace what it names)."""
    while True:
        if os.path.lexists(path) and os.access(path, os.W_OK, follow_symlinks=False):
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def untrusted_path_entries(paths: Iterable[str], roots: Iterable[str]) -> list[str]:
    """The ``sys.path`` entries the solution could put modules in: relative ones (the current directory), those
    inside ``roots`` (the tests' directories, the temporary directory) and, unless this is root (who can write
    everywhere; a root sandbox user is a weaker setup), those it can write."""
    real_roots = [os.path.realpath(root) for root in roots]
    root_user = os.geteuid() == 0
    untrusted = []
    for entry in paths:
        real = os.path.realpath(entry) if entry and os.path.isabs(entry) else ""
        if not real or _inside(real, real_roots) or (not root_user and _writable(real)):
            untrusted.append(entry)
    return untrusted


def strip_writable_paths(roots: Iterable[str]) -> list[str]:
    """Remove the untrusted entries from ``sys.path`` (and their cached finders); returns them."""
    untrusted = untrusted_path_entries(sys.path, roots)
    sys.path[:] = [entry for entry in sys.path if entry not in untrusted]
    for entry in untrusted:
        sys.path_importer_cache.pop(entry, None)
    return untrusted
