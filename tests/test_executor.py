"""The in-sandbox command executor (sandboxes/executor.py) and its async client, against a real executor process.

Every test that starts long-lived processes tags them with a unique marker (`sleep 1000.<random>`) so it can
check that they are gone, and kills leftovers by pid in a finally block so a failing test leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import pytest_asyncio

from sandboxes import executor as ex
from sandboxes.backend import SandboxError, SandboxSpec, repin_via_executor
from sandboxes.docker import DockerSandbox
from sandboxes.exec_wire import ExecRequest
from sandboxes.executor_answer import BadAnswer
from sandboxes.executor_client import (
    EXECUTOR_PATH,
    ExecutorUnavailable,
    call,
    encode_once,
    ping,
    wait_ready,
)
from sandboxes.file_wire import FileData, ReadFile, WriteFiles
from sandboxes.local import LocalProcessBackend, LocalSandbox

# The executor must run on any python3 >= 3.8 in user images: point this at another interpreter to check that.
EXECUTOR_PYTHON = os.environ.get("TANGRAM_EXECUTOR_PYTHON", sys.executable)

# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------


def marker() -> str:
    """A unique `sleep` argument: a long duration nobody else on the machine uses."""
    return f"1000.{random.randrange(10**8, 10**9)}"


def pids_with(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains `text`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(name))
    return found


def kill_marked(text: str) -> None:
    """Clean up after a failed test: SIGKILL the processes carrying this test's marker."""
    for pid in pids_with(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


def short_socket_path(tmp_path: Path) -> str:
    """tmp_path/x.sock, unless that exceeds the 107-byte AF_UNIX limit."""
    path = str(tmp_path / "x.sock")
    if len(path.encode()) < 100:
        return path
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ex-{os.getpid()}-{random.randrange(10**9)}.sock")


class Executor:
    """A real `executor.py serve` process."""

    def __init__(self, tmp_path: Path, socket_path: str | None = None, path: str = EXECUTOR_PATH) -> None:
        self.socket = socket_path or short_socket_path(tmp_path)
        self.log = tmp_path / "executor.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([EXECUTOR_PYTHON, path, "serve", "--socket", self.socket],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def stop(self) -> int:
        """Stop it with SIGTERM; one that has not exited after a generous bound (a loaded machine slows only the
        exit, a hang does not end) is killed and the test fails."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest_asyncio.fixture
async def executor(tmp_path: Path) -> AsyncIterator[Executor]:
    started = Executor(tmp_path)
    try:
        await wait_ready(started.socket, timeout=10)
        yield started
    finally:
        started.stop()


async def run(executor: Executor, **request: Any) -> dict[str, Any]:
    return await call(executor.socket, {"op": "run", **request})


def raw_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def raw_send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def raw_recv(sock: socket.socket) -> dict[str, Any] | None:
    def exact(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    header = exact(4)
    if header is None:
        return None
    body = exact(struct.unpack(">I", header)[0])
    assert body is not None
    return json.loads(body)


def raw_reply(sock: socket.socket) -> dict[str, Any]:
    """The next reply on a connection that must still be open."""
    reply = raw_recv(sock)
    assert reply is not None, "connection closed before a reply"
    return reply


# ------------------------------------------------------------------------------------------------------------
# basic runs
# ------------------------------------------------------------------------------------------------------------


async def test_ping_reports_executor_process(executor: Executor) -> None:
    answer = await ping(executor.socket)
    assert answer["ok"] is True
    assert answer["pid"] == executor.proc.pid
    probe = [EXECUTOR_PYTHON, "-c", "import platform; print(platform.python_version())"]
    done = await asyncio.to_thread(subprocess.run, probe, capture_output=True, text=True, check=True)
    version = done.stdout.strip()
    assert answer["python"] == version
    assert "serving on" in executor.log.read_text()
    assert os.stat(executor.socket).st_mode & 0o777 == 0o600


async def test_stdout_stderr_and_exit_code(executor: Executor) -> None:
    result = await run(executor, command="echo out; echo err >&2; exit 7")
    assert result["error"] is None
    assert (result["exit_code"], result["signal"]) == (7, None)
    assert result["stdout"] == "out\n" and result["stderr"] == "err\n"
    assert (result["stdout_bytes"], result["stderr_bytes"]) == (4, 4)
    assert not result["stdout_truncated"] and not result["stderr_truncated"]
    assert not result["timed_out"] and not result["oom_killed"]
    assert result["duration_s"] >= 0


async def test_argv_form_is_not_run_through_a_shell(executor: Executor) -> None:
    result = await run(executor, command=["echo", "$HOME; `id`", "two words"])
    assert result["exit_code"] == 0
    assert result["stdout"] == "$HOME; `id` two words\n"


async def test_env_is_added_and_cwd_applied(executor: Executor, tmp_path: Path) -> None:
    result = await run(executor, command='printf "%s|" "$TANGRAM_X" "$(pwd)"; command -v sh >/dev/null && echo path-ok',
                       env={"TANGRAM_X": "a b=c"}, cwd=str(tmp_path))
    assert result["exit_code"] == 0, result
    assert result["stdout"] == f"a b=c|{os.path.realpath(tmp_path)}|path-ok\n"


async def test_signal_death_reports_signal_not_exit_code(executor: Executor) -> None:
    result = await run(executor, command="kill -TERM $$")
    assert result["exit_code"] is None
    assert result["signal"] == signal.SIGTERM
    assert not result["timed_out"]


async def test_stdin_is_dev_null_and_output_decoded_with_replacement(executor: Executor) -> None:
    result = await run(executor, command=r"cat; printf 'ok\377'")
    assert result["exit_code"] == 0
    assert result["stdout"] == "ok\ufffd"
    assert result["stdout_bytes"] == 3


async def test_missing_cwd_is_an_error_and_creates_nothing(executor: Executor, tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "deeper"
    result = await run(executor, command="true", cwd=str(missing))
    assert "cwd" in result["error"] and str(missing) in result["error"]
    assert result["exit_code"] is None and result["stdout"] == "" and result["timed_out"] is False
    assert not missing.parent.exists()
    assert (await run(executor, command="echo alive"))["stdout"] == "alive\n"


async def test_the_runner_is_importable_where_the_broker_asks_for_it(executor: Executor) -> None:
    """``pytest_runner``: the runner's directory, beside the executor, comes first on PYTHONPATH, before what the
    command's environment had; without it nothing changes."""
    probe = "import tangram_runner, sys; print(sys.path[1] if sys.path[0] == '' else sys.path[0])"
    asked = await run(executor, command=[sys.executable, "-c", probe], pytest_runner=True,
                      env={"PYTHONPATH": "/elsewhere"})
    plain = await run(executor, command=[sys.executable, "-c", "import tangram_runner"])
    assert asked["exit_code"] == 0 and asked["stdout"].strip() == ex.RUNNER_DIR, asked
    assert ex.RUNNER_DIR.endswith("sandboxes/pytest_runner")
    assert plain["exit_code"] == 1 and "No module named 'tangram_runner'" in plain["stderr"]


async def test_background_runs_only_where_a_reap_ends_them(executor: Executor) -> None:
    """Outside a container (no --reap) nothing would end a background command with its environment: refused,
    starting nothing; a malformed flag is refused too."""
    mark = marker()
    refused = await run(executor, command=f"sleep {mark}", background=True)
    malformed = await run(executor, command="true", background="yes")
    assert refused["error"] is not None and "needs a container sandbox" in refused["error"], refused
    assert refused["exit_code"] is None and not pids_with(mark)
    assert malformed["error"] is not None and "background: must be true or false" in malformed["error"], malformed


async def test_missing_argv0_is_an_error_and_executor_survives(executor: Executor) -> None:
    result = await run(executor, command=["/nonexistent/tangram-no-such-binary", "x"])
    assert result["error"] is not None and "not found" in result["error"]
    assert result["exit_code"] is None and result["signal"] is None
    # Through a shell, a missing program is the shell's business: exit 127, no executor error.
    shell = await run(executor, command="tangram-no-such-binary-xyz")
    assert shell["error"] is None and shell["exit_code"] == 127
    assert (await ping(executor.socket))["pid"] == executor.proc.pid
    assert (await run(executor, command=["echo", "next"]))["stdout"] == "next\n"


@pytest.mark.parametrize(("request_fields", "field"), [
    ({"command": 5}, "command"),
    ({"command": []}, "command"),
    ({"command": ["echo", 1]}, "command"),
    ({}, "command"),
    ({"command": "true", "timeout_s": -1}, "timeout_s"),
    ({"command": "true", "timeout_s": "5"}, "timeout_s"),
    ({"command": "true", "output_limit": -1}, "output_limit"),
    ({"command": "true", "output_limit": 1.5}, "output_limit"),
    ({"command": "true", "cpus": "0"}, "cpus"),
    ({"command": "true", "cpus": [-1]}, "cpus"),
    ({"command": "true", "cpus": [True]}, "cpus"),
    ({"command": "true", "memory_bytes": 0}, "memory_bytes"),
    ({"command": "true", "env": {"A": 1}}, "env"),
    ({"command": "true", "env": ["A=1"]}, "env"),
    ({"command": "true", "cwd": 3}, "cwd"),
    ({"command": "true", "tag": ""}, "tag"),
    ({"command": "true", "tag": 5}, "tag"),
    ({"command": "true", "tag": "x" * 257}, "tag"),
    ({"op": "explode"}, "op"),
])
async def test_bad_requests_name_the_field(executor: Executor, request_fields: dict[str, Any], field: str) -> None:
    result = await call(executor.socket, request_fields)
    assert result["error"] is not None and result["error"].startswith(field), result
    assert result["exit_code"] is None and result["stdout"] == ""
    assert (await ping(executor.socket))["ok"]


async def test_unsatisfiable_cpu_set_is_an_error(executor: Executor) -> None:
    result = await run(executor, command="true", cpus=[4095])
    assert result["error"] is not None and result["error"].startswith("cpus")


# ------------------------------------------------------------------------------------------------------------
# output capture
# ------------------------------------------------------------------------------------------------------------


async def test_output_cap_keeps_prefix_and_counts_all(executor: Executor) -> None:
    result = await run(executor, command="head -c 3000000 /dev/zero; printf abcde >&2", output_limit=1000)
    assert result["exit_code"] == 0
    assert result["stdout"] == "\0" * 1000
    assert result["stdout_bytes"] == 3_000_000 and result["stdout_truncated"] is True
    assert result["stderr"] == "abcde" and result["stderr_bytes"] == 5 and result["stderr_truncated"] is False


async def test_default_output_limit_is_one_mib(executor: Executor) -> None:
    result = await run(executor, command="head -c 1048577 /dev/zero | tr '\\0' a")
    assert len(result["stdout"]) == 1024 * 1024
    assert result["stdout_bytes"] == 1024 * 1024 + 1 and result["stdout_truncated"] is True


async def test_background_process_holding_pipes_does_not_delay_response(executor: Executor) -> None:
    tag = f"30.{random.randrange(10**8, 10**9)}"
    try:
        started = time.monotonic()
        result = await run(executor, command=f"sleep {tag} & echo hi", timeout_s=60)
        elapsed = time.monotonic() - started
        assert result["stdout"] == "hi\n" and result["exit_code"] == 0
        assert not result["timed_out"]
        assert elapsed < 10, "waited for the background sleep to close the pipes"
        # (polled: /proc/<pid>/cmdline reads empty for an instant while the shell's fork execs sleep)
        assert await wait_until(lambda: bool(pids_with(f"sleep {tag}")), 3), \
            "a finished command's background process is left alone"
    finally:
        kill_marked(f"sleep {tag}")


# ------------------------------------------------------------------------------------------------------------
# timeout, cancellation and shutdown kill the whole tree
# ------------------------------------------------------------------------------------------------------------


async def test_timeout_kills_the_whole_tree(executor: Executor) -> None:
    tag = marker()
    # Same process group; own session via setsid (found through its parent); own process group and orphaned
    # (a job-control subshell that exits: only the session sweep finds it); and the foreground sleep.
    parts = [f"sleep {tag} &", "(set -m; sleep " + tag + " & ) ;"]
    if shutil.which("setsid"):
        parts.append(f"setsid sleep {tag} &")
    parts.append(f"echo started; sleep {tag}")
    try:
        started = time.monotonic()
        result = await run(executor, command=" ".join(parts), timeout_s=0.5)
        elapsed = time.monotonic() - started
        assert result["timed_out"] is True
        assert result["signal"] == signal.SIGKILL and result["exit_code"] is None
        assert result["stdout"] == "started\n", "output captured before the timeout is returned"
        assert result["error"] is None
        assert elapsed < 10
        assert await wait_until(lambda: not pids_with(f"sleep {tag}"), 3), pids_with(f"sleep {tag}")
    finally:
        kill_marked(f"sleep {tag}")


async def test_cancelling_the_call_kills_the_command(executor: Executor) -> None:
    tag = marker()
    try:
        task = asyncio.create_task(run(executor, command=f"sleep {tag} & sleep {tag}; echo never"))
        assert await wait_until(lambda: len(pids_with(f"sleep {tag}")) >= 2, 5), "command did not start"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_until(lambda: not pids_with(f"sleep {tag}"), 3), pids_with(f"sleep {tag}")
        assert (await ping(executor.socket))["pid"] == executor.proc.pid
    finally:
        kill_marked(f"sleep {tag}")


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_connections_run_concurrently(executor: Executor) -> None:
    tag = marker()
    try:
        slow = asyncio.create_task(run(executor, command=f"sleep {tag}", timeout_s=2))
        assert await wait_until(lambda: bool(pids_with(f"sleep {tag}")), 5)
        assert (await run(executor, command="echo quick"))["stdout"] == "quick\n"
        assert not slow.done(), "the quick command waited for the slow one"
        assert (await slow)["timed_out"] is True
    finally:
        kill_marked(f"sleep {tag}")


@asynccontextmanager
async def own_executor_running_a_sleep(tmp_path: Path) -> AsyncIterator[tuple[Executor, asyncio.Task[Any], str]]:
    """An executor of the test's own with a ``sleep`` call in flight; stopped and cleaned up afterwards."""
    own = Executor(tmp_path)
    tag = marker()
    try:
        await wait_ready(own.socket, timeout=10)
        task = asyncio.create_task(call(own.socket, {"command": f"sleep {tag}"}))
        assert await wait_until(lambda: bool(pids_with(f"sleep {tag}")), 5)
        yield own, task, tag
    finally:
        own.stop()
        kill_marked(f"sleep {tag}")


async def test_sigterm_stops_cleanly_and_kills_running_commands(tmp_path: Path) -> None:
    async with own_executor_running_a_sleep(tmp_path) as (own, task, tag):
        assert own.stop() == 0
        assert not os.path.exists(own.socket), "socket file removed on SIGTERM"
        with pytest.raises(ExecutorUnavailable):
            await task
        assert await wait_until(lambda: not pids_with(f"sleep {tag}"), 3)
        assert "stopped" in own.log.read_text()


async def test_executor_death_mid_command_raises_unavailable(tmp_path: Path) -> None:
    async with own_executor_running_a_sleep(tmp_path) as (own, task, _):
        own.proc.kill()  # the sandbox died (OOM-killed executor, container killed)
        with pytest.raises(ExecutorUnavailable) as info:
            await task
        assert info.value.socket_path == own.socket


def _connect_until(path: str, stop: threading.Event) -> None:
    """Connect and hang up, over and over: the executor keeps starting connection threads."""
    while not stop.is_set():
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)


def test_the_stop_handler_only_notes_the_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler raises nothing: it can run inside ``threading``'s lock code (the accepting thread waits for a
    connection's thread to start), whose cleanup then failed with its own error, which replaced the stop and left
    the executor serving (1 in ~600 SIGTERMs under load, before)."""
    class SignalledStderr:
        """A handler that runs inside ``_log``, whose write errors are ignored, is not swallowed either."""

        def write(self, _: str) -> int:
            ex._on_term(signal.SIGTERM, None)
            return 0

        def flush(self) -> None:
            pass

    monkeypatch.setattr(ex, "_stop_signals", [])
    monkeypatch.setattr(sys, "stderr", SignalledStderr())
    ex._log("serving")
    assert ex._stop_signals == [signal.SIGTERM]


def test_a_stop_while_connection_threads_start_ends_the_executor(tmp_path: Path) -> None:
    for attempt in range(6):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        own = Executor(folder)
        assert wait_for_socket(own.socket)
        stop = threading.Event()
        storm = threading.Thread(target=_connect_until, args=(own.socket, stop))
        storm.start()
        try:
            time.sleep(0.05)
            assert own.stop() == 0
        finally:
            stop.set()
            storm.join()


def wait_for_socket(path: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.01)
    return False


async def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = short_socket_path(tmp_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays behind, nobody listens: connecting is refused
    with pytest.raises(ExecutorUnavailable):
        await call(path, {"op": "ping"})
    own = Executor(tmp_path, path)
    try:
        assert (await wait_ready(own.socket, timeout=10))["pid"] == own.proc.pid
    finally:
        own.stop()


# ------------------------------------------------------------------------------------------------------------
# resources
# ------------------------------------------------------------------------------------------------------------


async def test_cpus_sets_exact_affinity(executor: Executor) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1]
    result = await run(executor, command="grep Cpus_allowed_list /proc/self/status", cpus=[core])
    assert result["exit_code"] == 0, result
    assert result["stdout"].split(":", 1)[1].strip() == str(core)
    argv = await run(executor, command=[sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                     cpus=[allowed[0]])
    assert argv["stdout"].strip() == f"[{allowed[0]}]"


def test_cpus_do_not_leak_into_later_commands_on_the_same_connection(executor: Executor) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two usable cores")
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with raw_connect(executor.socket) as sock:
        raw_send(sock, json.dumps({"command": probe, "cpus": [allowed[0]]}).encode())
        assert raw_reply(sock)["stdout"].strip() == f"[{allowed[0]}]"
        raw_send(sock, json.dumps({"command": probe}).encode())
        assert raw_reply(sock)["stdout"].strip() == str(allowed)


async def test_memory_bytes_limits_the_address_space(executor: Executor) -> None:
    limited = await run(executor, command=[sys.executable, "-c", "bytearray(500_000_000)"], memory_bytes=200_000_000)
    assert limited["error"] is None
    assert limited["exit_code"] not in (0, None), limited
    assert "MemoryError" in limited["stderr"]
    small = await run(executor, command=[sys.executable, "-c", "bytearray(10_000_000)"], memory_bytes=200_000_000)
    assert small["exit_code"] == 0, small


def test_oom_detection_uses_the_counter_and_sigkill(tmp_path: Path) -> None:
    """run_command in-process with a fake cgroup counter file that the command itself bumps."""
    counter = tmp_path / "memory.events"
    counter.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    bump = f"printf 'oom 2\\noom_kill 2\\n' > {counter};"
    killed = ex.run_command({"command": bump + " kill -KILL $$"}, oom_counter=str(counter))
    assert killed["signal"] == signal.SIGKILL and killed["oom_killed"] is True
    # Counter bumped but the process exited normally: not an OOM kill of this command.
    counter.write_text("oom_kill 5\n")
    survived = ex.run_command({"command": f"printf 'oom_kill 6\\n' > {counter}; exit 0"}, oom_counter=str(counter))
    assert survived["exit_code"] == 0 and survived["oom_killed"] is False
    # SIGKILL without a counter increase (someone else's kill): not OOM.
    plain = ex.run_command({"command": "kill -KILL $$"}, oom_counter=str(counter))
    assert plain["signal"] == signal.SIGKILL and plain["oom_killed"] is False


def test_oom_counter_resolution(tmp_path: Path) -> None:
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 12\n")
    assert ex.read_oom_counter(str(v1)) == 12
    assert ex.read_oom_counter(str(tmp_path / "missing")) is None
    assert ex.resolve_oom_counter("none") is None
    assert ex.resolve_oom_counter(str(v1)) == str(v1)
    auto = ex.resolve_oom_counter("auto")
    assert auto is None or ex.read_oom_counter(auto) is not None


def test_proc_table_parses_comm_with_spaces_and_parentheses(tmp_path: Path) -> None:
    weird = tmp_path / "a) b (c"
    weird.symlink_to(shutil.which("sleep") or "/bin/sleep")
    proc = subprocess.Popen([str(weird), "1000"], start_new_session=True)
    try:
        assert Path(f"/proc/{proc.pid}/stat").read_text().count(")") >= 2
        _state, ppid, session = ex._proc_table()[proc.pid]
        assert (ppid, session) == (os.getpid(), proc.pid)
        ex.kill_tree(proc.pid)
        assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------------------------
# re-pinning a running command (malleable actions): op "cpus"
# ------------------------------------------------------------------------------------------------------------


def two_cores() -> tuple[int, int]:
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, f"re-pinning tests need two usable cores, have {allowed}"
    return allowed[0], allowed[-1]


def affinities(pids: list[int]) -> dict[int, set[int]]:
    """tid -> affinity for every thread of these processes."""
    found = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            found[int(tid)] = os.sched_getaffinity(int(tid))
    return found


#: a process with a second thread, so that re-pinning must reach every thread, not just the main one
THREADED_SLEEP = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"


async def test_cpus_op_repins_every_thread_of_the_running_tree(executor: Executor) -> None:
    first, second = two_cores()
    mark = marker()
    # sh (the command), a background sleep, and a python with two threads under it: all carry the marker
    command = f"sleep {mark} & {sys.executable} -c '{THREADED_SLEEP}' {mark} & wait"
    try:
        task = asyncio.create_task(run(executor, command=command, cpus=[first], tag="act-1"))
        assert await wait_until(lambda: len(pids_with(mark)) == 3 and len(affinities(pids_with(mark))) == 4, 10)
        assert set(map(frozenset, affinities(pids_with(mark)).values())) == {frozenset({first})}
        answer = await call(executor.socket, {"op": "cpus", "tag": "act-1", "cpus": [second]})
        assert answer == {"ok": True, "processes": 3}
        assert set(map(frozenset, affinities(pids_with(mark)).values())) == {frozenset({second})}
        refused = await call(executor.socket, {"op": "cpus", "tag": "act-1", "cpus": [4095]})
        assert refused["ok"] is False and refused["error"].startswith("cpus"), refused
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_until(lambda: not pids_with(mark), 3), pids_with(mark)
    finally:
        kill_marked(mark)


async def test_cpus_sent_before_the_run_are_the_ones_it_starts_on(executor: Executor) -> None:
    first, second = two_cores()
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    early = await call(executor.socket, {"op": "cpus", "tag": "act-2", "cpus": [second]})
    assert early == {"ok": True, "processes": 0}
    result = await run(executor, command=probe, cpus=[first], tag="act-2")
    assert result["stdout"].strip() == f"[{second}]", result
    # the remembered cpus went with the command that ended: the tag's next run gets its own
    again = await run(executor, command=probe, cpus=[first], tag="act-2")
    assert again["stdout"].strip() == f"[{first}]", again


@pytest.mark.parametrize(("request_fields", "field"), [
    ({"cpus": [0]}, "tag"),
    ({"tag": "", "cpus": [0]}, "tag"),
    ({"tag": ["a"], "cpus": [0]}, "tag"),
    ({"tag": "t"}, "cpus"),
    ({"tag": "t", "cpus": "0"}, "cpus"),
    ({"tag": "t", "cpus": []}, "cpus"),
    ({"tag": "t", "cpus": [-1]}, "cpus"),
    ({"tag": "t", "cpus": [0.5]}, "cpus"),
])
async def test_bad_cpus_requests_name_the_field(executor: Executor, request_fields: dict[str, Any], field: str) -> None:
    answer = await call(executor.socket, {"op": "cpus", **request_fields})
    assert answer["ok"] is False and answer["error"].startswith(field), answer
    assert (await ping(executor.socket))["ok"]


async def test_local_sandbox_set_action_cores_reaches_its_executor(tmp_path: Path) -> None:
    """The host side of the op: cores reach the executor, a refusal is a SandboxError, a dead executor a lost one."""
    first, second = two_cores()
    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"lx-{random.randrange(10**9)}"  # short socket paths
    backend = LocalProcessBackend(run_dir)
    await backend.start()
    sandbox = await backend.create(SandboxSpec(env_id="e1", task="t", trajectory=None, image="-", memory_mb=512,
                                               pids_limit=64))
    try:
        await sandbox.set_action_cores("act-3", frozenset({second}))
        probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
        result = await sandbox.run(ExecRequest(tuple(probe), cores=(first,), tag="act-3"))
        assert result.stdout.strip() == f"[{second}]", result
        with pytest.raises(SandboxError) as refused:
            await sandbox.set_action_cores("act-3", frozenset())
        assert not refused.value.lost and "cpus" in refused.value.message
    finally:
        await sandbox.destroy()
        shutil.rmtree(run_dir, ignore_errors=True)
    with pytest.raises(SandboxError) as gone:
        await sandbox.set_action_cores("act-3", frozenset({first}))
    assert gone.value.lost


def test_cpus_for_tags_that_never_run_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ex, "MAX_REMEMBERED_TAGS", 3)
    monkeypatch.setattr(ex, "_tag_cpus", type(ex._tag_cpus)())
    for i in range(5):
        assert ex.set_tag_cpus({"tag": f"never-{i}", "cpus": [0]}) == {"ok": True, "processes": 0}
    ex.set_tag_cpus({"tag": "never-2", "cpus": [1]})  # sent again: the newest now
    assert list(ex._tag_cpus.items()) == [("never-3", [0]), ("never-4", [0]), ("never-2", [1])]


# ------------------------------------------------------------------------------------------------------------
# framing, once mode, availability
# ------------------------------------------------------------------------------------------------------------


def test_one_connection_carries_several_requests_and_survives_bad_json(executor: Executor) -> None:
    with raw_connect(executor.socket) as sock:
        raw_send(sock, b'{"op": "ping"}')
        assert raw_reply(sock)["ok"] is True
        raw_send(sock, b"{not json")
        assert "invalid JSON" in raw_reply(sock)["error"]
        raw_send(sock, json.dumps({"command": ["echo", "3rd"]}).encode())
        assert raw_reply(sock)["stdout"] == "3rd\n"


def test_oversized_request_is_rejected_and_closed(executor: Executor) -> None:
    with raw_connect(executor.socket) as sock:
        sock.sendall(struct.pack(">I", ex.MAX_REQUEST_BYTES + 1))
        answer = raw_recv(sock)
        assert answer is not None and "limit" in answer["error"]
        assert raw_recv(sock) is None, "connection closed after the oversized frame"


async def test_file_bytes_travel_raw_and_every_byte_value_round_trips(executor: Executor, tmp_path: Path) -> None:
    """A write's files and a read's file go raw after their frames; the JSON's "payload" counts them."""
    every = bytes(range(256)) * 4097  # a little over 1 MiB: more than one recv
    written = await call(executor.socket, WriteFiles({"a/every.bin": every, "b.bin": b"", "c.txt": b"\x00\n"})
                         .to_wire(str(tmp_path)))
    assert written == {"ok": True, "files": 3, "bytes": len(every) + 2}
    assert (tmp_path / "a" / "every.bin").read_bytes() == every and (tmp_path / "c.txt").read_bytes() == b"\x00\n"
    answer = await call(executor.socket, ReadFile("a/every.bin", len(every)).to_wire(str(tmp_path)))
    assert answer["payload"] == every and ReadFile("a/every.bin", len(every)).answer(answer).data == every
    with raw_connect(executor.socket) as sock:  # the raw frame: JSON counting the bytes, then the bytes
        raw_send(sock, json.dumps({"op": "read", "root": str(tmp_path), "path": "c.txt", "limit": 10}).encode())
        assert raw_reply(sock) == {"ok": True, "type": "file", "payload": 2}
        assert sock.recv(16, socket.MSG_WAITALL) == b"\x00\n"
        raw_send(sock, b'{"op": "ping"}')  # the connection goes on after the payload
        assert raw_reply(sock)["ok"] is True


@pytest.mark.parametrize("payload", [ex.MAX_REQUEST_BYTES, -1, "12", True])
def test_a_payload_past_the_cap_or_not_a_count_is_refused_and_closed(executor: Executor, payload: Any) -> None:
    with raw_connect(executor.socket) as sock:
        raw_send(sock, json.dumps({"op": "write", "root": "/", "files": [], "payload": payload}).encode())
        answer = raw_recv(sock)
        assert answer is not None and answer["error"].startswith(("request", "payload")), answer
        assert raw_recv(sock) is None, "connection closed after the refused frame"


def test_a_payload_shorter_than_its_count_ends_the_connection_unanswered(executor: Executor) -> None:
    with raw_connect(executor.socket) as sock:
        raw_send(sock, json.dumps({"op": "write", "root": "/", "files": [{"path": "x", "size": 100}],
                                   "payload": 100}).encode())
        sock.sendall(b"x" * 10)
        sock.shutdown(socket.SHUT_WR)
        assert raw_recv(sock) is None
    assert executor.proc.poll() is None


def test_a_write_whose_sizes_do_not_add_up_to_its_payload_is_refused(tmp_path: Path) -> None:
    request = {"op": "write", "root": str(tmp_path), "files": [{"path": "x", "size": 3}], "payload": b"ab"}
    assert ex.handle_request(request)["code"] == "file_bad_request"
    assert ex.handle_request({**request, "files": [{"path": "x", "size": -1}]})["code"] == "file_bad_request"
    assert not (tmp_path / "x").exists()


@asynccontextmanager
async def answering(path: str, answer: bytes) -> AsyncIterator[None]:
    """A fake executor at ``path`` that reads one request (its payload included) and sends ``answer`` bytes."""

    def serve() -> None:
        conn, _addr = server.accept()
        with conn:
            conn.settimeout(10)
            length = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
            payload = json.loads(conn.recv(length, socket.MSG_WAITALL)).get("payload", 0)
            conn.recv(payload, socket.MSG_WAITALL)
            conn.sendall(answer)

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(10)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=15)
        server.close()


@pytest.mark.parametrize("announced", [11, -1, "3", None])
async def test_an_answer_announcing_a_payload_past_the_read_limit_is_refused_unread(tmp_path: Path,
                                                                                    announced: Any) -> None:
    path = short_socket_path(tmp_path)
    body = json.dumps({"ok": True, "type": "file", "payload": announced}).encode()
    async with answering(path, struct.pack(">I", len(body)) + body + b"x" * 11):
        with pytest.raises(BadAnswer, match="payload"):
            await call(path, ReadFile("f", 10).to_wire("/"), connect_timeout=10)


async def test_an_answer_whose_payload_ends_short_is_unavailable_not_a_hang(tmp_path: Path) -> None:
    path = short_socket_path(tmp_path)
    body = json.dumps({"ok": True, "type": "file", "payload": 10}).encode()
    async with answering(path, struct.pack(">I", len(body)) + body + b"x" * 4):
        with pytest.raises(ExecutorUnavailable, match="4 of 10 bytes"):
            await asyncio.wait_for(call(path, ReadFile("f", 10).to_wire("/"), connect_timeout=10), 20)


def test_once_mode_carries_file_bytes_as_base64(tmp_path: Path) -> None:
    every = bytes(range(256))
    for request in (WriteFiles({"every.bin": every}).to_wire(str(tmp_path)),
                    ReadFile("every.bin", 256).to_wire(str(tmp_path))):
        done = subprocess.run([EXECUTOR_PYTHON, EXECUTOR_PATH, "once", encode_once(request)],
                              capture_output=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
    assert ReadFile("every.bin", 256).answer(json.loads(done.stdout)) == FileData(False, every)


def test_once_mode_runs_one_request() -> None:
    request = {"command": "echo once; echo e >&2; exit 4", "env": {"Q": "1"}}
    done = subprocess.run([EXECUTOR_PYTHON, EXECUTOR_PATH, "once", encode_once(request)],
                          capture_output=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(b"\n") == 1
    result = json.loads(done.stdout)
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (4, "once\n", "e\n")
    # Standard base64 without padding is accepted too.
    std = base64.b64encode(json.dumps({"command": ["printf", "%s", "+/?>"]}).encode()).decode().rstrip("=")
    done = subprocess.run([EXECUTOR_PYTHON, EXECUTOR_PATH, "once", std], capture_output=True, timeout=30, check=False)
    assert json.loads(done.stdout)["stdout"] == "+/?>"
    bad = subprocess.run([EXECUTOR_PYTHON, EXECUTOR_PATH, "once", "%%%"], capture_output=True, timeout=30, check=False)
    assert bad.returncode == 0 and json.loads(bad.stdout)["error"].startswith("request")


async def test_unavailable_when_nothing_listens(tmp_path: Path) -> None:
    path = str(tmp_path / "none.sock")
    with pytest.raises(ExecutorUnavailable) as info:
        await call(path, {"op": "ping"})
    assert info.value.socket_path == path
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailable, match="not ready"):
        await wait_ready(path, timeout=0.3)
    assert time.monotonic() - started < 5


async def test_connect_retries_while_the_listen_backlog_is_full(tmp_path: Path) -> None:
    """A non-blocking unix connect gets EAGAIN on a full backlog; that must be retried, not turned into a
    half-made connection (asyncio's own open_unix_connection treats EAGAIN as "in progress")."""
    path = short_socket_path(tmp_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    served = 0

    def serve_late() -> None:
        nonlocal served
        time.sleep(0.3)  # let the clients pile up against the backlog first
        server.settimeout(10)
        for _ in range(20):
            conn, _addr = server.accept()
            with conn:
                conn.settimeout(10)
                length = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
                conn.recv(length, socket.MSG_WAITALL)
                raw_send(conn, json.dumps({"ok": True}).encode())
                served += 1

    thread = threading.Thread(target=serve_late, daemon=True)
    thread.start()
    try:
        answers = await asyncio.gather(*(call(path, {"op": "ping"}, connect_timeout=10) for _ in range(20)))
        assert answers == [{"ok": True}] * 20
    finally:
        thread.join(timeout=15)
        server.close()
    assert served == 20


async def test_wait_ready_waits_for_a_starting_executor(tmp_path: Path) -> None:
    path = short_socket_path(tmp_path)
    own: Executor | None = None

    async def start_later() -> None:
        nonlocal own
        await asyncio.sleep(0.2)
        own = Executor(tmp_path, path)

    starter = asyncio.create_task(start_later())
    try:
        answer = await wait_ready(path, timeout=15)
        await starter
        assert own is not None and answer["pid"] == own.proc.pid
    finally:
        await starter
        if own is not None:
            own.stop()


@pytest.fixture(autouse=True)
def _no_leftover_executors() -> Iterator[None]:
    """Every test stops the executors it started."""
    yield
    mine = [pid for pid in pids_with(EXECUTOR_PATH) if ex._proc_table().get(pid, ("", 0, 0))[1] == os.getpid()]
    assert not mine, f"executor processes left running: {mine}"


async def test_an_executor_older_than_repinning_is_told_apart_from_a_refusal(tmp_path: Path) -> None:
    """Sandboxes adopted across a broker upgrade run the executor they were created with. One that predates the
    "cpus" op must not fail every resize on Docker (the cgroup still moves the command there); without a cgroup
    (local backend) the resize fails with a reason that says so."""
    source = Path(EXECUTOR_PATH).read_text()
    branch = '    if op == "cpus":\n'
    assert source.count(branch) == 1
    older = tmp_path / "executor.py"
    older.write_text(source.replace(branch, '    if op == "cpus-not-yet":\n'))
    root = Path(short_socket_path(tmp_path)).with_suffix(".d")  # LocalSandbox serves on root/exec.sock
    root.mkdir()
    started = Executor(tmp_path, socket_path=str(root / "exec.sock"), path=str(older))
    try:
        await wait_ready(started.socket, timeout=10)
        assert await repin_via_executor(started.socket, "act-1", frozenset({0})) is False
        sandbox = LocalSandbox("env-old", root, psutil.Process(started.proc.pid), 256)
        with pytest.raises(SandboxError) as refused:
            await sandbox.set_action_cores("act-1", frozenset({0}))
        assert refused.value.code == "repin_failed" and "older broker" in refused.value.message
        adopted = DockerSandbox(None, SimpleNamespace(short_id="c0ffee"), root, None,  # type: ignore[arg-type]
                                socket_dir=root)
        await adopted.set_action_cores("act-1", frozenset({0}))  # the cgroup moves the command: no failure
        assert adopted.old_executor
        started.stop()
        await adopted.set_action_cores("act-1", frozenset({0}))  # not asked again (a gone executor would raise)
    finally:
        started.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_a_current_executor_refusing_cpus_is_a_failure(executor: Executor) -> None:
    command = asyncio.create_task(run(executor, command="sleep 30", tag="act-1", timeout_s=30))
    try:
        while not command.done():  # the tag's command is running once a re-pin moves a process
            answer = await call(executor.socket, {"op": "cpus", "tag": "act-1", "cpus": [0]})
            if answer.get("processes"):
                break
            await asyncio.sleep(0.02)
        with pytest.raises(SandboxError) as refused:
            await repin_via_executor(executor.socket, "act-1", frozenset({4095}))  # no such cpu: the kernel refuses
        assert refused.value.code == "repin_failed" and "4095" in refused.value.message
    finally:
        command.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await command
