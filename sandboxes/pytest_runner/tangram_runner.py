"""ARL-Tangram's elastic pytest runner: collect once, fork the workers, follow the cores.

Why: ``pytest -n`` (xdist) starts each worker as a fresh interpreter that imports and collects the whole suite
again, and fixes its worker count at launch. This plugin's coordinator collects once and never runs a test; it
forks its workers after collection (copy-on-write: no re-import), and workers pull small slices of one module's
tests at a time, so module fixtures stay cheap. The worker count follows the cores the process may run on: when
the broker moves the command onto more cores (its executor re-pins the whole process tree) the coordinator forks
more workers at once; on fewer, surplus workers finish their current test and hand their slice back.

Each worker runs its tests in collection order: tests that leave global state behind for later ones pass as under
plain pytest. Given the tests an earlier run found long (``TANGRAM_RUNNER_LONG_TESTS``, what
``--tangram-long-tests`` printed, kept by the broker per action signature), a long test's module starts first (a
long test started late ends the run alone) on a worker that then goes on from there; one that finds no test left
after its own is replaced by a fresh fork, which takes those before. A worker asks for its next slice as it starts
the last test of the one it has (that test's teardown needs to know the next), so that slice waits behind the test:
a slice ends at a long test, and the ask made before one gets a single test, so that none waits behind it while
other workers run dry.

Each worker sets up its own session fixtures and has its own ``basetemp``, as under xdist. Reports travel back
through pytest's own report serialisation and are replayed in the coordinator, so the terminal, ``-x``,
``--maxfail``, junit XML and the exit code are plain pytest's. A worker that dies fails the test it was running and
is replaced (at most MAX_RESTARTS times). Where forking is not safe (a thread alive after collection, no
``os.fork``, xdist asked for too) it runs plain pytest and says why.

It is copied into every sandbox beside the executor, so it uses the standard library and pytest only, and runs
on python3 >= 3.8 with pytest >= 7. Used as ``pytest -p tangram_runner --tangram-workers N`` with its directory on
``PYTHONPATH``.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import warnings

import pytest

#: how often the coordinator looks at its cores while it waits for workers
CORES_POLL_S = 0.05
#: how often the coordinator reads the workers' progress (test starts, reports): batched so that a worker sharing
#: a core with it is not interrupted after every test; a worker's requests, failures and end are read at once
BATCH_S = 0.02
#: each worker's buffer for the progress it sends between two reads
PROGRESS_BUFFER_BYTES = 1 << 20
#: workers that died and were replaced, at most this many times per worker slot
MAX_RESTARTS = 4
#: a worker pulls about this share of the tests left per worker at a time (small slices: a shrink takes effect
#: within one test, and the last slices spread over every worker)
SLICES_PER_WORKER = 4
#: the line every run prints, and that the broker reads: which runner ran, with how many workers, or why not
BANNER = "tangram-runner:"
#: the line ``--tangram-long-tests`` prints: ``{nodeid: seconds}`` of the run's longest tests
LONG_TESTS_LINE = "tangram-runner-long-tests:"
#: a test that took at least this long is named there: a slice ends at it, and no slice waits behind it
LONG_TEST_S = 1.0
#: how many tests that line names at most (the longest)
LONG_TESTS_KEPT = 32
#: the long tests of an earlier run, read at the start (what that line printed, kept by the broker)
LONG_TESTS_ENV = "TANGRAM_RUNNER_LONG_TESTS"

_HEADER = struct.Struct(">I")
_LAUNCH_CORES = pytest.StashKey[int]()
_SAID = pytest.StashKey[str]()
_LONG_TESTS = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("tangram", "ARL-Tangram's elastic runner")
    group.addoption("--tangram-workers", type=int, default=0, metavar="N",
                    help="run the tests in N forked workers after one collection, following the cores the process "
                         "is given (0: off, plain pytest)")
    group.addoption("--tangram-launch-cores", type=int, default=0, metavar="C",
                    help="the cores the command was started on (0: those of this process as pytest starts): the "
                         "workers follow the cores added or taken since")
    group.addoption("--tangram-long-tests", action="store_true", default=False,
                    help=f"print the tests that took {LONG_TEST_S:g} s or more ({LONG_TESTS_KEPT} at most) as one "
                         f"JSON line (given back in {LONG_TESTS_ENV}, no slice of a later run waits behind them)")


def pytest_configure(config):
    config.stash[_LAUNCH_CORES] = config.getoption("tangram_launch_cores") or _cores()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    config = session.config
    workers = config.getoption("tangram_workers")
    if not workers or workers < 1 or config.option.collectonly:
        return None
    if session.testsfailed and not config.option.continue_on_collection_errors:
        return None  # the default loop stops on collection errors, as plain pytest does
    refusal = _cannot_fork(config)
    if refusal is not None:
        _say(config, f"plain pytest ({refusal})")
        return None
    coordinator = _Coordinator(session, workers, _earlier_long_tests())
    coordinator.run()
    _say(config, coordinator.summary())
    if config.getoption("tangram_long_tests"):
        config.stash[_LONG_TESTS] = coordinator.long_tests()
    if session.shouldfail:
        raise session.Failed(session.shouldfail)
    if session.shouldstop:
        raise session.Interrupted(session.shouldstop)
    return True


def _cannot_fork(config):
    """Why forking workers is not safe here, or None."""
    if not hasattr(os, "fork") or not hasattr(os, "sched_getaffinity"):
        return "this platform cannot fork workers"
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} thread(s) alive after collection would not survive a fork"
    if getattr(config.option, "numprocesses", None) or getattr(config.option, "dist", "no") != "no":
        return "xdist was asked for too"
    return None


def _say(config, text):
    """What the run's summary will say of the runner (``pytest_terminal_summary``)."""
    config.stash[_SAID] = text


def pytest_terminal_summary(terminalreporter, config):
    said = config.stash.get(_SAID, None)
    if said is not None:
        terminalreporter.write_line(f"{BANNER} {said}")
    long_tests = config.stash.get(_LONG_TESTS, None)
    if long_tests:
        terminalreporter.write_line(f"{LONG_TESTS_LINE} {json.dumps(long_tests)}")


def _earlier_long_tests():
    """Node id -> seconds from ``LONG_TESTS_ENV``; empty where it is absent or not such a JSON object (a hint only:
    which worker runs a test changes, never which tests run)."""
    try:
        given = json.loads(os.environ.get(LONG_TESTS_ENV) or "{}")
    except ValueError:
        return {}
    if not isinstance(given, dict):
        return {}
    return {nodeid: float(seconds) for nodeid, seconds in given.items()
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0}


def _cores():
    """The cores this process may run on (the broker re-pins the whole tree, and a cgroup cpuset change resets the
    mask too)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# -- the wire between coordinator and workers: 4-byte length, then JSON -------------------------------------------
#
# Each worker has two socket pairs to the coordinator. Its progress (a test started, its reports, its warnings, its
# end) goes on the first, buffered by the kernel and read every BATCH_S. Its requests for tests, the tests it hands
# back and its failures go on the second, which the coordinator answers at once, after reading the worker's
# progress so far; the coordinator's answers and stops come back on it too. A worker that dies closes both: what
# it sent before is read first, so the test it died in is known.

def _frame(message):
    body = json.dumps(message, default=repr).encode()
    return _HEADER.pack(len(body)) + body


def _send(sock, message):
    sock.sendall(_frame(message))


def _frames(buffer):
    """The complete messages at the front of ``buffer`` (a bytearray), removed from it."""
    messages = []
    start = 0
    while len(buffer) - start >= _HEADER.size:
        size = _HEADER.unpack_from(buffer, start)[0]
        if len(buffer) - start - _HEADER.size < size:
            break
        messages.append(json.loads(bytes(buffer[start + _HEADER.size:start + _HEADER.size + size])))
        start += _HEADER.size + size
    del buffer[:start]
    return messages


def _recv(sock):
    """One message, or None at the end of the stream (the other side is gone)."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(header)[0])
    return None if body is None else json.loads(body)


def _recv_exact(sock, size):
    chunks = []
    while size:
        try:
            chunk = sock.recv(size)
        except OSError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# -- the coordinator --------------------------------------------------------------------------------------------

class _Worker:
    def __init__(self, slot, pid, sock, progress):
        self.slot = slot
        self.pid = pid
        self.sock = sock  # requests and answers
        self.progress = progress  # what it reports, read in batches
        self.unread = bytearray()
        self.assigned = collections.deque()  # indices sent and not finished, in order
        self.running = None  # the index it started and did not finish
        self.stopping = False
        self.retiring = False  # only tests before its last are left: it ends after its test, and is replaced
        self.last = -1  # the highest index it was given: it takes only later ones, in collection order


class _Coordinator:
    """Hands slices of the collected items to forked workers and replays their reports."""

    def __init__(self, session, workers, long_tests):
        self.session = session
        self.config = session.config
        self.items = session.items
        self.requested = workers
        self.cores_at_start = self.config.stash[_LAUNCH_CORES]
        # modules in collection order, each a deque of item indices; slices are cut from the front of one
        numbers = {}
        self.modules = []
        self.module_of = []  # item index -> module number
        for index, item in enumerate(self.items):
            number = numbers.setdefault(item.nodeid.split("::")[0], len(numbers))
            if number == len(self.modules):
                self.modules.append(collections.deque())
            self.modules[number].append(index)
            self.module_of.append(number)
        self.front = 0  # no module before it has tests left
        self.left = len(self.items)
        self.returned = collections.deque()  # handed back by a worker that stopped or died: taken first, by any
        self.long = {index for index, item in enumerate(self.items) if item.nodeid in long_tests}
        longest = {}  # module -> its longest known test's seconds: these modules start first, longest first
        for index in self.long:
            number = self.module_of[index]
            longest[number] = max(longest.get(number, 0.0), long_tests[self.items[index].nodeid])
        self.first_modules = sorted(longest, key=lambda number: -longest[number])  # until a slice is cut from one
        self.replaced = 0
        self.test_seconds = collections.defaultdict(float)  # what each test took in this run (its phases)
        self.workers = {}
        self.next_slot = 0
        self.restarts = 0
        self.started = 0
        self.targets = []  # the worker count the cores allowed, each time it changed
        self.draining = False  # -x or --maxfail reached: no more tests start, later reports are dropped
        self.failing_nodeid = None

    def target(self):
        """The worker count the cores allow now: the requested count, moved by as many cores as were added or
        taken since the start (at least one)."""
        return max(1, self.requested + _cores() - self.cores_at_start)

    def summary(self):
        text = f"{self.started} worker(s) forked after one collection"
        if self.long:
            text += f", {len(self.long)} long test(s) known from an earlier run"
        if self.replaced:
            text += f", {self.replaced} replaced to keep each worker's tests in collection order"
        if len(self.targets) > 1:
            text += ", following the cores: " + " -> ".join(map(str, self.targets))
        if self.restarts:
            text += f", {self.restarts} died (each replaced while tests were left)"
        return text

    def long_tests(self):
        """This run's tests of at least LONG_TEST_S, the LONG_TESTS_KEPT longest, and their seconds."""
        longest = sorted(self.test_seconds.items(), key=lambda entry: -entry[1])[:LONG_TESTS_KEPT]
        return {nodeid: round(seconds, 3) for nodeid, seconds in longest if seconds >= LONG_TEST_S}

    def run(self):
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is not None:  # nothing captured so far may be printed twice by a worker
            out, err = capman.read_global_capture()
            sys.stdout.write(out)
            sys.stderr.write(err)
        factory = getattr(self.config, "_tmp_path_factory", None)
        if factory is not None:
            factory.getbasetemp()  # made once here; each worker takes a directory inside it
        gc.freeze()  # what collection made stays shared: the workers' collections do not copy its pages
        self._adjust()
        read_at = time.monotonic() + BATCH_S
        while self.workers:
            wait = min(CORES_POLL_S, max(0.0, read_at - time.monotonic()))
            ready, _, _ = select.select([w.sock for w in self.workers.values()], [], [], wait)
            for sock in ready:
                worker = next(w for w in self.workers.values() if w.sock is sock)
                self._read_progress(worker)  # what it sent before this request comes first
                message = _recv(sock)
                if message is None:
                    self._lost(worker)
                else:
                    self._handle(worker, message)
            if time.monotonic() >= read_at:
                for worker in list(self.workers.values()):
                    self._read_progress(worker)
                read_at = time.monotonic() + BATCH_S
            self._adjust()

    def _read_progress(self, worker):
        """Handle every complete message the worker's progress channel holds now, without waiting."""
        while True:
            try:
                chunk = worker.progress.recv(PROGRESS_BUFFER_BYTES)
            except OSError:  # nothing more now (BlockingIOError), or the worker is gone
                break
            if not chunk:
                break
            worker.unread += chunk
        for message in _frames(worker.unread):
            self._handle(worker, message)

    def _adjust(self):
        """Fork workers up to the target while tests are left; ask the surplus to stop."""
        if self.draining:
            return
        active = [w for w in self.workers.values() if not w.stopping]
        target = self.target()
        if not self.targets or self.targets[-1] != target:
            self.targets.append(target)
        while len(active) < target and self._tests_left():
            active.append(self._fork())
        for worker in active[target:]:
            worker.stopping = True
            self._tell(worker, {"t": "stop"})

    def _tests_left(self):
        return self.left > 0

    def _slice(self, worker, size=None):
        """The worker's next slice: ``size`` tests, or about 1/SLICES_PER_WORKER of each worker's share, from the
        tests handed back or else from one module after its last test, ending at a long test. None: only tests
        before its last are left."""
        if self.returned:
            source = self.returned
        else:
            number = self._module_for(worker)
            if number is None:
                return None if self.left else []
            source = self.modules[number]
            if number in self.first_modules:
                self.first_modules.remove(number)
        if size is None:
            size = max(1, self.left // (SLICES_PER_WORKER * max(1, len(self.workers))))
        piece = []
        while source and len(piece) < size:
            piece.append(source.popleft())
            if piece[-1] in self.long:
                break
        self.left -= len(piece)
        worker.last = max(worker.last, *piece)
        return piece

    def _module_for(self, worker):
        """The module a worker's next slice comes from: one of a long test that no worker has started, the longest
        first, while other workers run too; else the first with tests left after the worker's last test."""
        while self.front < len(self.modules) and not self.modules[self.front]:
            self.front += 1
        if sum(1 for other in self.workers.values() if not other.stopping) > 1:
            for number in self.first_modules:
                if self.modules[number] and self.modules[number][0] > worker.last:
                    return number
        start = max(self.front, self.module_of[worker.last] if worker.last >= 0 else 0)
        for number in range(start, len(self.modules)):
            if self.modules[number] and self.modules[number][0] > worker.last:
                return number
        return None

    def _hand_back(self, indices):
        """Tests a worker was given and will not run: the next asks take them, in their order."""
        self.returned.extendleft(reversed(indices))
        self.left += len(indices)

    def _fork(self):
        slot = self.next_slot
        self.next_slot += 1
        mine, theirs = socket.socketpair()
        progress_in, progress_out = socket.socketpair()
        progress_out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PROGRESS_BUFFER_BYTES)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            mine.close()
            progress_in.close()
            for other in self.workers.values():
                other.sock.close()
                other.progress.close()
            code = 1
            channel = _Channel(theirs, progress_out)
            try:
                code = _WorkerLoop(self.session, channel, slot).run()
            except OSError:
                pass  # the coordinator is gone (its end of the socket closed): nobody to report to
            except BaseException:  # noqa: BLE001 - a worker must never run the coordinator's code after fork
                import traceback

                traceback.print_exc()
            finally:
                try:
                    channel.flush()  # what it kept (a test's end) if it stopped on an error
                except OSError:
                    pass
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        theirs.close()
        progress_out.close()
        progress_in.setblocking(False)
        worker = _Worker(slot, pid, mine, progress_in)
        self.workers[pid] = worker
        self.started += 1
        return worker

    def _tell(self, worker, message):
        try:
            _send(worker.sock, message)
        except OSError:
            pass  # it is gone: its end of stream says so

    def _handle(self, worker, message):
        kind = message["t"]
        if kind == "next":
            if self.draining or worker.stopping or worker.retiring:
                piece = []
            else:  # the test it asks before was long: one test only (its teardown's next), none waiting behind it
                piece = self._slice(worker, 1 if message.get("before") in self.long else None)
                if piece is None:  # a fresh worker takes the tests before this one's last, once it has ended
                    piece = []
                    worker.retiring = True
                    self.replaced += 1
            worker.assigned.extend(piece)
            self._tell(worker, {"t": "items", "items": piece})
        elif kind == "start":
            worker.running = message["i"]
            if not self.draining:
                item = self.items[message["i"]]
                self.config.hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        elif kind == "report":
            report = self.config.hook.pytest_report_from_serializable(config=self.config,
                                                                      data=_tuples_back(message["r"]))
            self.test_seconds[report.nodeid] += getattr(report, "duration", 0.0) or 0.0
            if not self.draining or report.nodeid == self.failing_nodeid:
                self.config.hook.pytest_runtest_logreport(report=report)
                if not self.draining and (self.session.shouldfail or self.session.shouldstop):
                    self._drain(report.nodeid)
        elif kind == "warning":
            if not self.draining:
                self.config.hook.pytest_warning_recorded.call_historic(kwargs=_warning_from(message))
        elif kind == "finish":
            index = message["i"]
            worker.running = None
            if index in worker.assigned:
                worker.assigned.remove(index)
            if not self.draining or self.items[index].nodeid == self.failing_nodeid:
                item = self.items[index]
                self.config.hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        elif kind == "returned":  # a stopping worker's unstarted tests go back to the front
            returned = [i for i in message["items"] if i in worker.assigned]
            for index in returned:
                worker.assigned.remove(index)
            if returned:
                self._hand_back(returned)

    def _drain(self, nodeid):
        self.draining = True
        self.failing_nodeid = nodeid
        for worker in self.workers.values():
            worker.stopping = True
            self._tell(worker, {"t": "stop"})

    def _lost(self, worker):
        """A worker's stream ended: it exited (its work done or handed back) or died mid-test."""
        self._read_progress(worker)
        worker.sock.close()
        worker.progress.close()
        del self.workers[worker.pid]
        _, status = os.waitpid(worker.pid, 0)
        if worker.running is not None and not self.draining:
            self._crashed(worker, worker.running, status)
        left = [i for i in worker.assigned if i != worker.running]
        if left:
            self._hand_back(left)
        if worker.running is not None or (status and not worker.stopping):
            self.restarts += 1
            if self.restarts > MAX_RESTARTS * max(1, self.requested):
                self.draining = True  # workers keep dying: the rest of the suite is not run
                self.session.shouldstop = f"{BANNER} workers died {self.restarts} times; stopped"

    def _crashed(self, worker, index, status):
        """Fail the test a dead worker was running, as xdist does."""
        from _pytest.reports import TestReport

        item = self.items[index]
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        report = TestReport(item.nodeid, item.location, {}, "failed",
                            f"worker {worker.slot} (pid {worker.pid}) died running this test ({how})", "call")
        self.config.hook.pytest_runtest_logreport(report=report)
        self.config.hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        if self.session.shouldfail or self.session.shouldstop:
            self._drain(item.nodeid)


# -- a worker ---------------------------------------------------------------------------------------------------

class _Channel:
    """A worker's two channels to the coordinator: progress is kept and sent once per test (``flush``), requests
    and failures go at once (after the progress before them)."""

    def __init__(self, sock, progress):
        self.sock = sock
        self.progress = progress
        self.kept = []

    def post(self, message):
        self.kept.append(_frame(message))

    def flush(self):
        if self.kept:
            self.progress.sendall(b"".join(self.kept))
            self.kept = []

    def send(self, message):
        self.flush()
        _send(self.sock, message)


class _Forward:
    """In a worker: what pytest reports goes to the coordinator, not to a terminal. Warnings recorded before it
    (collection's, replayed to it as it registers: the hook is historic) are the coordinator's already."""

    def __init__(self, config, channel):
        self.config = config
        self.channel = channel
        self.registered = False

    def pytest_runtest_logreport(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        if report.failed:  # the coordinator may have to stop the run (-x, --maxfail) now
            self.channel.send({"t": "report", "r": data})
        else:
            self.channel.post({"t": "report", "r": data})

    def pytest_warning_recorded(self, warning_message, when, nodeid, location):
        if not self.registered:
            return
        self.channel.post({"t": "warning", "message": str(warning_message.message),
                           "category": f"{warning_message.category.__module__}:"
                                       f"{warning_message.category.__qualname__}",
                           "filename": warning_message.filename, "lineno": warning_message.lineno,
                           "when": when, "nodeid": nodeid, "location": location})


def _tuples_back(data):
    """A serialised report as pytest made it: JSON turned its tuples (a skip's longrepr, the location) into lists."""
    for key in ("longrepr", "location"):
        if isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    return data


def _warning_from(message):
    module, _, name = message["category"].partition(":")
    category = getattr(sys.modules.get(module), name, None)
    if not (isinstance(category, type) and issubclass(category, Warning)):
        category = UserWarning
    warning = warnings.WarningMessage(category(message["message"]), category, message["filename"],
                                      message["lineno"])
    location = tuple(message["location"]) if message["location"] else None
    return {"warning_message": warning, "when": message["when"], "nodeid": message["nodeid"], "location": location}


class _Silenced:
    """In a worker: the terminal reporter as other code finds it, writing nowhere and with none of its hooks (the
    coordinator reports). Failed comparisons need its writer (``config.get_terminal_writer()``) for their diff."""

    def __init__(self, reporter):
        from _pytest._io import TerminalWriter

        quiet = TerminalWriter(open(os.devnull, "w"))  # noqa: SIM115 - the worker's whole life, closed at exit
        quiet.hasmarkup = reporter._tw.hasmarkup
        quiet.code_highlight = getattr(reporter._tw, "code_highlight", False)
        reporter._tw = quiet
        self._reporter = reporter

    def __getattr__(self, name):
        return getattr(self._reporter, name)


class _WorkerLoop:
    """One forked worker: runs the slices it is handed, one test at a time, until told to stop or none are left."""

    def __init__(self, session, channel, slot):
        self.session = session
        self.config = session.config
        self.channel = channel
        self.slot = slot
        self.stop = False

    def run(self):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        self._own_capture_and_tmp()
        manager = self.config.pluginmanager
        reporter = manager.get_plugin("terminalreporter")
        if reporter is not None:
            manager.unregister(reporter)
            manager.register(_Silenced(reporter), "terminalreporter")
        forward = _Forward(self.config, self.channel)
        manager.register(forward, "tangram-forward")
        forward.registered = True
        items = self.session.items
        queue = collections.deque(self._ask(None))
        ran_any = False
        while queue and not self.stop:
            index = queue.popleft()
            if not queue:
                queue.extend(self._ask(index))
            self._poll()
            if self.stop:
                queue.appendleft(index)
                break
            nextitem = items[queue[0]] if queue else None
            self.channel.post({"t": "start", "i": index})
            self.channel.flush()  # the coordinator must know which test this is if the worker dies in it
            self.config.hook.pytest_runtest_protocol(item=items[index], nextitem=nextitem)
            ran_any = True
            self.channel.post({"t": "finish", "i": index})
            if self.session.shouldfail or self.session.shouldstop:
                self.stop = True
        if queue:
            self.channel.send({"t": "returned", "items": list(queue)})
        if ran_any and (queue or self.stop):
            self._tear_down()  # the last test ran with a next one in view: its fixtures are still set up
        return 0

    def _own_capture_and_tmp(self):
        """Capture into files of its own (the coordinator's are shared across the fork) and take a basetemp
        directory of its own."""
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        if capman is not None:
            capman.stop_global_capturing()
            capman.start_global_capturing()
            capman.suspend_global_capture()
        factory = getattr(self.config, "_tmp_path_factory", None)
        if factory is not None:
            mine = factory.getbasetemp() / f"worker{self.slot}"
            mine.mkdir()
            factory._basetemp = mine

    def _ask(self, before):
        """The next slice from the coordinator (empty: none left, or this worker is to stop), asked for before the
        test ``before`` (None: before the first)."""
        self.channel.send({"t": "next", "before": before})
        while True:
            message = _recv(self.channel.sock)
            if message is None:  # the coordinator is gone
                self.stop = True
                return []
            if message["t"] == "stop":
                self.stop = True
            elif message["t"] == "items":
                return message["items"]

    def _poll(self):
        """Take a stop the coordinator sent since the last test, without waiting."""
        while select.select([self.channel.sock], [], [], 0)[0]:
            message = _recv(self.channel.sock)
            if message is None or message["t"] == "stop":
                self.stop = True
                return

    def _tear_down(self):
        setup_state = getattr(self.session, "_setupstate", None)
        if setup_state is not None and hasattr(setup_state, "teardown_exact"):
            setup_state.teardown_exact(None)
