"""ARL-Tangram's elastic pytest runner: collect once, fork the workers, follow the cores.

Why: ``pytest -n`` (xdist) starts each worker as a fresh interpreter that imports and collects the whole suite
again, and fixes its worker count at launch. This plugin's coordinator collects once and never runs a test; it
forks its workers after collection (copy-on-write: no re-import), and workers pull small slices of one module's
tests at a time, so module fixtures stay cheap. The worker count follows the cores the process may run on: when
the broker moves the command onto more cores (its executor re-pins the whole process tree) the coordinator forks
more workers at once; on fewer, surplus workers finish their current test and hand their slice back.

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

_HEADER = struct.Struct(">I")
_LAUNCH_CORES = pytest.StashKey[int]()
_SAID = pytest.StashKey[str]()


def pytest_addoption(parser):
    group = parser.getgroup("tangram", "ARL-Tangram's elastic runner")
    group.addoption("--tangram-workers", type=int, default=0, metavar="N",
                    help="run the tests in N forked workers after one collection, following the cores the process "
                         "is given (0: off, plain pytest)")
    group.addoption("--tangram-launch-cores", type=int, default=0, metavar="C",
                    help="the cores the command was started on (0: those of this process as pytest starts): the "
                         "workers follow the cores added or taken since")


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
    coordinator = _Coordinator(session, workers)
    coordinator.run()
    _say(config, coordinator.summary())
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


class _Coordinator:
    """Hands slices of the collected items to forked workers and replays their reports."""

    def __init__(self, session, workers):
        self.session = session
        self.config = session.config
        self.items = session.items
        self.requested = workers
        self.cores_at_start = self.config.stash[_LAUNCH_CORES]
        # modules in collection order, each a deque of item indices; slices are cut from the front module
        modules = collections.OrderedDict()
        for index, item in enumerate(self.items):
            modules.setdefault(item.nodeid.split("::")[0], collections.deque()).append(index)
        self.queue = collections.deque(modules.values())
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
        if len(self.targets) > 1:
            text += ", following the cores: " + " -> ".join(map(str, self.targets))
        if self.restarts:
            text += f", {self.restarts} died (each replaced while tests were left)"
        return text

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
        return any(self.queue)

    def _slice(self):
        """The next slice of the front module's tests: about 1/SLICES_PER_WORKER of each worker's share."""
        while self.queue and not self.queue[0]:
            self.queue.popleft()
        if not self.queue:
            return []
        left = sum(len(module) for module in self.queue)
        size = max(1, left // (SLICES_PER_WORKER * max(1, len(self.workers))))
        module = self.queue[0]
        return [module.popleft() for _ in range(min(size, len(module)))]

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
            if self.draining or worker.stopping:
                piece = []
            else:
                piece = self._slice()
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
                self.queue.appendleft(collections.deque(returned))

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
            self.queue.appendleft(collections.deque(left))
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
    """In a worker: what pytest reports goes to the coordinator, not to a terminal."""

    def __init__(self, config, channel):
        self.config = config
        self.channel = channel

    def pytest_runtest_logreport(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        if report.failed:  # the coordinator may have to stop the run (-x, --maxfail) now
            self.channel.send({"t": "report", "r": data})
        else:
            self.channel.post({"t": "report", "r": data})

    def pytest_warning_recorded(self, warning_message, when, nodeid, location):
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
        manager.register(_Forward(self.config, self.channel), "tangram-forward")
        items = self.session.items
        queue = collections.deque(self._ask())
        ran_any = False
        while queue and not self.stop:
            index = queue.popleft()
            if not queue:
                queue.extend(self._ask())
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

    def _ask(self):
        """The next slice from the coordinator (empty: none left, or this worker is to stop)."""
        self.channel.send({"t": "next"})
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
