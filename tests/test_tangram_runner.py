"""The elastic pytest runner (``sandboxes/pytest_runner/tangram_runner.py``, issue 36): a run's outcome is plain
pytest's, its workers follow the cores, and nothing outlives it.

A small suite made here covers what a runner can get wrong (session fixtures per worker, a failure, a skip, an
xfail, a warning, a test that kills its worker, ``-x``, junit XML); it runs under this venv's pytest, its process
tree re-pinned by ``os.sched_setaffinity`` as the executor re-pins a command's. Real suites (pinned PyPI sdists,
``loadtest/suites.py``) run in the default sandbox image, whose pytest is older, plain and through the runner.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import docker
import psutil
import pytest

from loadtest.suites import DEFAULT_CACHE_DIR, SUITES, fetch
from managers.cpu.exec_spec import RUNNER_BANNER
from managers.cpu.long_tests import LONG_TESTS_ENV, LONG_TESTS_LINE, TESTS_KEPT
from sandboxes.image import DEFAULT_IMAGE
from tests.docker_nodes import docker_engines

pytestmark = pytest.mark.slow  # real pytest suites run under the runner

RUNNER_DIR = Path(__file__).resolve().parent.parent / "sandboxes" / "pytest_runner"
#: the counts of pytest's last line, without warnings and time (which may differ)
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|deselected)\b")

SUITE = '''
import os, time, warnings
import pytest

warnings.warn("imported", UserWarning)

@pytest.fixture(scope="session")
def session_setup(tmp_path_factory):
    mark = tmp_path_factory.getbasetemp() / f"session-{os.getpid()}"
    mark.write_text("up")
    yield
    mark.write_text("torn down")

@pytest.mark.parametrize("i", range(30))
def test_work(i, session_setup, tmp_path):
    (tmp_path / "out").write_text(str(i))
    time.sleep(0.01)

def test_fails():
    assert [1, 2] == [1, 3]

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.xfail
def test_expected_to_fail():
    assert 0

def test_warns():
    warnings.warn("careful", DeprecationWarning)

def test_kills_its_process():
    if os.environ.get("KILL_WORKER"):
        os._exit(3)
'''


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    (tmp_path / "test_suite.py").write_text(SUITE)
    return tmp_path


def pytest_run(where: Path, *args: str, env: dict[str, str] | None = None,
               basetemp: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` in ``where`` with the runner importable. Without pytest-rerunfailures: installed beside
    pytest-xdist (as in this project's dev environment), it starts a server thread at configure, and the runner then
    rightly runs plain pytest (a thread would not survive the fork)."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:rerunfailures",
               "-W", "ignore::pytest.PytestWarning",
               "--basetemp", str(basetemp or where / "tmp"), *args]
    full_env = {**os.environ, "PYTHONPATH": str(RUNNER_DIR), **(env or {})}
    return subprocess.run(command, check=False, cwd=where, env=full_env, capture_output=True, text=True,
                          timeout=300)


def counts(output: str) -> dict[str, int]:
    last = output.strip().splitlines()[-1]
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in COUNTS.findall(last)}


def warnings(output: str) -> int:
    found = re.search(r"(\d+) warnings?\b", output.strip().splitlines()[-1])
    return int(found.group(1)) if found else 0


def runner(workers: int, *extra: str) -> tuple[str, ...]:
    return ("-p", "tangram_runner", f"--tangram-workers={workers}", *extra)


def test_two_workers_report_what_plain_pytest_reports(suite: Path) -> None:
    """Counts, exit code, failure text (a comparison's diff too), warnings (collection's too) and junit XML match
    plain pytest's; each worker set up and tore down its own session fixture in a basetemp of its own."""
    plain = pytest_run(suite, "-q", "--junitxml=plain.xml", basetemp=suite / "plain")
    forked = pytest_run(suite, "-q", "--junitxml=forked.xml", *runner(2), basetemp=suite / "forked")
    assert forked.returncode == plain.returncode == 1, forked.stdout + forked.stderr
    assert counts(forked.stdout) == counts(plain.stdout) == {"failed": 1, "passed": 32, "skipped": 1,
                                                              "xfailed": 1}, forked.stdout
    assert "tangram-runner: 2 worker(s) forked after one collection" in forked.stdout
    assert warnings(forked.stdout) == warnings(plain.stdout) == 2, forked.stdout  # one in collection, one in a test
    for text in ("assert [1, 2] == [1, 3]", "At index 1 diff: 2 != 3", "DeprecationWarning: careful",
                 "FAILED test_suite.py::test_fails"):
        assert text in forked.stdout and text in plain.stdout, text

    def junit(name: str) -> dict[str, str]:
        root = ElementTree.parse(suite / name).getroot()
        suite_element = root if root.tag == "testsuite" else root[0]
        return {key: suite_element.get(key, "") for key in ("tests", "failures", "errors", "skipped")}

    assert junit("forked.xml") == junit("plain.xml")
    marks = sorted((suite / "forked").glob("worker*/session-*"))
    assert len(marks) == 2 and all(mark.read_text() == "torn down" for mark in marks), marks


def test_a_worker_that_dies_fails_its_test_and_is_replaced(suite: Path) -> None:
    """``os._exit`` in a test: that test fails naming the dead worker, the rest of the suite still runs."""
    forked = pytest_run(suite, "-q", *runner(2), env={"KILL_WORKER": "1"})
    assert forked.returncode == 1
    assert counts(forked.stdout) == {"failed": 2, "passed": 31, "skipped": 1, "xfailed": 1}, forked.stdout
    assert "FAILED test_suite.py::test_kills_its_process" in forked.stdout
    assert re.search(r"worker \d+ \(pid \d+\) died running this test \(exit status 3\)", forked.stdout), \
        forked.stdout
    assert "1 died" in forked.stdout


def test_exitfirst_stops_the_run(suite: Path) -> None:
    """``-x``: the run stops at the first failure with plain pytest's exit code and message; tests already running
    in other workers may finish, as under xdist."""
    forked = pytest_run(suite, "-q", "-x", *runner(2))
    assert forked.returncode == 1 and "stopping after 1 failures" in forked.stdout, forked.stdout
    assert counts(forked.stdout)["failed"] == 1


def test_collection_errors_stop_before_any_worker(tmp_path: Path) -> None:
    (tmp_path / "test_broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")
    plain = pytest_run(tmp_path, "-q")
    forked = pytest_run(tmp_path, "-q", *runner(2))
    assert forked.returncode == plain.returncode == 2
    assert "tangram-runner" not in forked.stdout and "1 error" in forked.stdout


def test_a_thread_alive_after_collection_runs_plain_pytest_and_says_why(suite: Path) -> None:
    (suite / "conftest.py").write_text("import threading, time\n"
                                       "def pytest_collection_finish(session):\n"
                                       "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    forked = pytest_run(suite, "-q", *runner(2))
    assert "tangram-runner: plain pytest (1 thread(s) alive after collection would not survive a fork)" \
        in forked.stdout, forked.stdout
    assert counts(forked.stdout) == {"failed": 1, "passed": 32, "skipped": 1, "xfailed": 1}


def test_a_run_names_its_long_tests_and_a_malformed_list_changes_nothing(tmp_path: Path) -> None:
    for name, seconds in (("test_a.py", 0.0), ("test_b.py", 1.05)):
        (tmp_path / name).write_text(f"import time\ndef test_it():\n    time.sleep({seconds})\n")
    first = pytest_run(tmp_path, "-q", *runner(2, "--tangram-long-tests"))
    line = next(line for line in first.stdout.splitlines() if line.startswith("tangram-runner-long-tests: "))
    named = json.loads(line.split(" ", 1)[1])
    assert list(named) == ["test_b.py::test_it"] and named["test_b.py::test_it"] >= 1.0, first.stdout
    for malformed in ("not json", "[1, 2]", '"test_b.py::test_it"'):
        ignored = pytest_run(tmp_path, "-q", *runner(2), env={"TANGRAM_RUNNER_LONG_TESTS": malformed})
        assert counts(ignored.stdout) == counts(first.stdout) == {"passed": 2}
        assert "known from an earlier run" not in ignored.stdout and "tangram-runner-long-tests" not in ignored.stdout


def test_no_slice_waits_behind_a_test_an_earlier_run_found_long(tmp_path: Path) -> None:
    """The long test is the first of its module, so that the slice its worker takes would hold the tests after it
    while the other worker runs dry. Given an earlier run's times, that slice ends at the long test and the worker
    asks, before it, for one test only (the next, which its teardown needs): the long test waits (60 s at most) until
    the other worker has run every other quick test, which it can only do when nothing else waits behind it."""
    done = tmp_path / "done.log"
    quick = 80
    (tmp_path / "test_slices.py").write_text(
        "import os, time, pytest\n"
        f"DONE = {str(done)!r}\n"
        "def ran():\n"
        "    return open(DONE).read().count('quick') if os.path.exists(DONE) else 0\n"
        "def test_long():\n"
        "    deadline = time.monotonic() + 60\n"
        f"    while ran() < {quick - 1} and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    open(DONE, 'a').write(f'{os.getpid()} long {ran()}\\n')\n"
        f"@pytest.mark.parametrize('i', range({quick}))\n"
        "def test_quick(i):\n"
        "    open(DONE, 'a').write(f'{os.getpid()} quick\\n')\n")
    given = json.dumps({"test_slices.py::test_long": 60.0, "gone.py::test_x": 9.0})
    run = pytest_run(tmp_path, "-q", *runner(2), env={"TANGRAM_RUNNER_LONG_TESTS": given})
    assert run.returncode == 0 and counts(run.stdout) == {"passed": quick + 1}, run.stdout
    entries = [line.split() for line in done.read_text().splitlines()]
    long_pid, _, seen = next(entry for entry in entries if entry[1] == "long")
    assert int(seen) == quick - 1, entries  # it did not wait out its deadline
    assert sum(1 for pid, kind, *_ in entries if pid == long_pid and kind == "quick") == 1, entries
    assert "1 long test(s) known from an earlier run" in run.stdout


def test_a_long_tests_module_starts_first_and_every_worker_keeps_collection_order(tmp_path: Path) -> None:
    """The long test's module is the last collected and leaves state behind that the first module's tests refuse
    (as mpmath's change its global precision). Its worker starts there; it then has no test left after its own
    while the first module's are not done (here they wait for the last module's to end), so a fresh worker takes them:
    every test passes, as under plain pytest."""
    marker = tmp_path / "z-done"
    (tmp_path / "test_a.py").write_text(
        "import os, time, pytest\n"
        "@pytest.mark.parametrize('i', range(40))\n"
        "def test_clean(i):\n"
        "    deadline = time.monotonic() + (60 if os.environ.get('WAIT_FOR_Z') else 0)\n"
        f"    while not os.path.exists({str(marker)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    assert 'POLLUTED' not in os.environ\n")
    (tmp_path / "test_z.py").write_text(
        "import os\n"
        "def test_long():\n"
        "    os.environ['POLLUTED'] = '1'\n"
        "def test_after():\n"
        f"    open({str(marker)!r}, 'w').close()\n")
    plain = pytest_run(tmp_path, "-q", basetemp=tmp_path / "plain")
    marker.unlink()
    given = json.dumps({"test_z.py::test_long": 30.0})
    run = pytest_run(tmp_path, "-q", *runner(2), env={"TANGRAM_RUNNER_LONG_TESTS": given, "WAIT_FOR_Z": "1"})
    assert run.returncode == plain.returncode == 0 and counts(run.stdout) == counts(plain.stdout) == {"passed": 42}, \
        run.stdout
    assert "3 worker(s) forked after one collection, 1 long test(s) known from an earlier run, 1 replaced " \
           "to keep each worker's tests in collection order" in run.stdout, run.stdout


def test_the_broker_reads_and_writes_what_the_runner_writes_and_reads() -> None:
    """The runner cannot import the broker's modules (it runs in users' images), so its names are spelled twice."""
    spec = importlib.util.spec_from_file_location("runner_under_test", RUNNER_DIR / "tangram_runner.py")
    assert spec is not None and spec.loader is not None
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    assert (plugin.BANNER, plugin.LONG_TESTS_LINE, plugin.LONG_TESTS_ENV) == \
        (RUNNER_BANNER, LONG_TESTS_LINE, LONG_TESTS_ENV)
    assert plugin.LONG_TESTS_KEPT <= TESTS_KEPT


def tree_of(pid: int) -> list[psutil.Process]:
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def repin(pid: int, cores: set[int]) -> None:
    """What the executor does on a resize: every thread of every process of the command's tree."""
    for process in tree_of(pid):
        for thread in process.threads():
            try:
                os.sched_setaffinity(thread.id, cores)
            except OSError:
                pass  # gone since the listing


def wait_for_progress(log: Path, process: subprocess.Popen[str]) -> None:
    """Until the run has reported a few tests (the workers run)."""
    deadline = time.monotonic() + 120
    while "....." not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


@pytest.mark.parametrize("change", ["grow", "shrink"])
def test_the_workers_follow_the_cores(tmp_path: Path, change: str) -> None:
    """Re-pinned onto two cores from one, the coordinator forks a second worker; onto one from two, a worker hands
    its tests back and exits. Every test runs once either way, and no process of the run is left."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.fail("this test needs two cores")
    (tmp_path / "test_long.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.parametrize('i', range(80))\n"
        "def test_busy(i):\n"
        "    end = time.monotonic() + 0.03\n"
        "    while time.monotonic() < end:\n"
        "        pass\n")
    start, end = ({cores[0]}, set(cores[:2])) if change == "grow" else (set(cores[:2]), {cores[0]})
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["taskset", "-c", ",".join(map(str, sorted(start))), sys.executable, "-m", "pytest", "-q", "-p",
             "no:cacheprovider", "-p", "no:rerunfailures", "-W", "ignore::pytest.PytestWarning",
             *runner(len(start), f"--tangram-launch-cores={len(start)}")],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(RUNNER_DIR)}, stdout=out, stderr=subprocess.STDOUT,
            text=True)
        try:
            wait_for_progress(log, process)
            repin(process.pid, end)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    output = log.read_text()
    assert process.returncode == 0 and counts(output) == {"passed": 80}, output
    assert f"2 worker(s) forked after one collection, following the cores: {len(start)} -> {len(end)}" in output, \
        output
    assert not tree_of(process.pid)


# -- real suites in the sandbox image ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def image_engine() -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=docker_engines()[0])
    yield client
    client.close()


@pytest.mark.parametrize("name", ["pyflakes", "lark"])
def test_real_suites_count_the_same_in_the_sandbox_image(name: str, image_engine: docker.DockerClient,
                                                          tmp_path: Path) -> None:
    """A real project's suite, in the image's own pytest, plain and through the runner on two workers: the same
    counts and exit code."""
    suite = next(s for s in SUITES if s.name == name)
    fetched = fetch(suite, DEFAULT_CACHE_DIR)
    with tarfile.open(DEFAULT_CACHE_DIR / suite.sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    outcomes = {}
    for label, extra in (("plain", ""), ("runner", "-p tangram_runner --tangram-workers=2")):
        command = (f"cd /suite && PYTHONPATH=/runner python3 -m pytest -q -p no:cacheprovider {extra} "
                   f"{suite.test_args}; echo exit=$?")
        output = image_engine.containers.run(
            DEFAULT_IMAGE, ["sh", "-c", command], network_mode="none", remove=True, cpuset_cpus="0,1",
            volumes={str(tmp_path / fetched.root): {"bind": "/suite", "mode": "rw"},
                     str(RUNNER_DIR): {"bind": "/runner", "mode": "ro"}}).decode()
        lines = output.strip().splitlines()
        outcomes[label] = (counts("\n".join(lines[:-1])), lines[-1])
        if label == "runner":
            assert "tangram-runner: 2 worker(s) forked after one collection" in output, output[-2000:]
    assert outcomes["runner"] == outcomes["plain"], outcomes
