"""The pytest plugin of a test-scored reward (``-p tangram_client.reward_report``): it counts the tests in the one
process that sees every outcome and signs the count, and it keeps the processes of pytest out of the solution's
reach.

In every pytest process (the single one, or xdist's controller and each worker), at ``pytest_configure``, before any
solution code can exist: the process is made undumpable (``tangram_client/pytest_guard.py``), the solution's gate is
closed (``tangram_client/solution_proxy.py``: nothing of it runs while pytest collects), and a crashed xdist worker is
not replaced (a new worker would read test files the solution may have rewritten by then). Where tests are collected,
once they are: the shim ``solution`` is imported (a test importing it later finds it loaded), ``sys.path`` loses every
directory the solution can write, and the gate opens. The reporting process (not a worker) reads and deletes the key
file first; once every process has collected the tests (before xdist schedules any), it deletes the test files, which
would show the solution the expected answers; it counts each collected test once (passed: its call passed and no phase
failed; skipped: skipped or xfail/xpass, as the test asked; failed: the rest, including tests that never reported), and
at the end writes the signed line (``tangram_client/signed_report.py``) to the stderr it had at configure.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tangram_client.pytest_guard import make_undumpable, strip_writable_paths
from tangram_client.signed_report import KEY_FILE, signed_line
from tangram_client.solution_proxy import MODULE_NAME, close_gate, open_gate, shutdown

#: a key longer than this is not ours
MAX_KEY_BYTES = 4096


def read_key(path: Path) -> bytes | None:
    """The key in ``path``, which is deleted: a regular file, not a link, at most ``MAX_KEY_BYTES``; None when
    there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not (info.st_mode & 0o170000 == 0o100000 and 0 < info.st_size <= MAX_KEY_BYTES):
            return None
        return os.read(fd, MAX_KEY_BYTES).strip() or None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def hide_tests(paths: set[Path]) -> None:
    """Delete the test files: read by every pytest process, they would show the solution the expected answers."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


class RewardReport:
    """The counts, kept by the reporting process; the key never leaves it."""

    def __init__(self, config: pytest.Config, key: bytes, stderr_fd: int) -> None:
        self.config = config
        self.key = key
        self.stderr_fd = stderr_fd
        self.collected = 0
        self.collected_by: set[str] = set()
        self.passed: set[str] = set()
        self.failed: set[str] = set()
        self.skipped: set[str] = set()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = len(session.items)
        hide_tests({item.path for item in session.items})

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """Called before xdist schedules anything: once every worker has collected, nothing reads the tests."""
        self.collected = max(self.collected, len(ids))
        self.collected_by.add(str(node.gateway.id))
        workers = self.config.option.numprocesses
        if isinstance(workers, int) and len(self.collected_by) >= workers:
            hide_tests({self.config.rootpath / nodeid.split("::")[0] for nodeid in ids})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        elif report.skipped or hasattr(report, "wasxfail"):
            self.skipped.add(report.nodeid)
        elif report.when == "call" and report.passed:
            self.passed.add(report.nodeid)

    def counts(self) -> dict[str, int]:
        skipped = self.skipped - self.failed
        passed = self.passed - self.failed - skipped
        collected = max(self.collected, len(self.passed | self.failed | self.skipped))
        return {"collected": collected, "passed": len(passed), "skipped": len(skipped),
                "failed": collected - len(passed) - len(skipped)}

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self) -> None:
        shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(self.stderr_fd, (signed_line(self.key, self.counts()) + "\n").encode())
        os.close(self.stderr_fd)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    make_undumpable()
    close_gate()
    if hasattr(config.option, "maxworkerrestart"):
        config.option.maxworkerrestart = "0"
    if _is_worker(config):
        return
    key = read_key(config.invocation_params.dir / KEY_FILE)
    if key is not None:  # without it there is no report, and the reward scores 0
        config.pluginmanager.register(RewardReport(config, key, os.dup(2)), "tangram-reward-report")


def _trusted_sys_path(config: pytest.Config) -> None:
    strip_writable_paths([str(config.invocation_params.dir), str(config.rootpath), os.getcwd(),
                          tempfile.gettempdir()])


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        _trusted_sys_path(session.config)  # xdist's controller collects nothing: nothing more to import


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    if MODULE_NAME not in sys.modules and (session.config.invocation_params.dir / f"{MODULE_NAME}.py").is_file():
        importlib.import_module(MODULE_NAME)
    _trusted_sys_path(session.config)
    open_gate()


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutdown()
