"""In-sandbox command executor for ARL-Tangram.

Why: `docker exec` costs ~40 ms per call, which dominates short tool actions on the broker's hot path. This
executor runs inside the sandbox (a container, or a plain local process standing for one), listens on a unix
socket, and runs commands with CPU affinity, a timeout that kills the whole process tree, size-capped output
capture and OOM detection; a round trip for `true` is ~1 ms plus process spawn.

It is copied into arbitrary user images, so it is stdlib-only (with executor_files.py beside it) and runs on any
python3 >= 3.8.

Wire protocol (both directions): 4-byte big-endian unsigned length, then that many bytes of UTF-8 JSON. A file
op's bytes travel raw after their frame (no base64 to encode and decode, no JSON to scan): the JSON's "payload" is
their count (a write's request, a read's answer). In once mode they are base64 in the JSON's "payload" instead.
Requests carry "op": "ping", "run" (the default), "cpus", "write" or "read":

* run: see run_command for the fields and the response. An optional "tag" names the command for "cpus";
  "pytest_runner": true puts the elastic pytest runner shipped beside this file on the command's PYTHONPATH.
  "stream": true (serve mode) sends the output as it comes, before the answer, in frames {"stream": "stdout" or
  "stderr", "payload": N} each followed by N raw bytes: only bytes the answer keeps (output_limit per stream), so
  the answer's stdout/stderr are what was streamed. An executor that predates it ignores the field and just answers.
* cpus: {"op": "cpus", "tag": T, "cpus": [ints]} moves the running command tagged T, every thread of every
  process in its tree, onto those cpus (a malleable action whose cores grow or shrink while it runs); answers
  {"ok": true, "processes": N re-pinned} or {"ok": false, "error": "..."}. When no command tagged T runs yet,
  the cpus are remembered and a later run tagged T starts on them instead of its own "cpus".
* write, read: files under the working directory, resolved here in the sandbox (executor_files.py, shipped beside
  this file).

Modes:
    python3 executor.py serve --socket PATH [--oom-counter auto|none|FILE] [--reap]
    python3 executor.py once BASE64 [--oom-counter auto|none|FILE] [--reap]   (one request from argv, response on
                                                                              stdout)

--reap (in a container only, where the executor's PID namespace is the sandbox's): after a run with "reap": true,
every process left in the sandbox is killed unless another command runs (reap_leftovers), but those of background
runs ("background": true, start_background), which live as long as the sandbox.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import errno
import json
import math
import os
import platform
import pwd
import resource
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

try:  # run as a script, beside this file (in a sandbox)
    import egress_relay
    import executor_files
except ImportError:  # imported as sandboxes.executor (the broker, tests)
    from sandboxes import egress_relay, executor_files

#: what a ping answers, so that a broker knows what an executor it did not ship (an adopted sandbox's) understands.
#: 1: run, cpus, ping. 2: run's background, pytest_runner, stdin and user; the write and read ops; streamed output.
PROTOCOL_VERSION = 2
# a write's files arrive base64-encoded in one request: 16 MiB of files ([cpu.limits] max_files_bytes) and their JSON
MAX_REQUEST_BYTES = 24 * 1024 * 1024
DEFAULT_OUTPUT_LIMIT = 1024 * 1024
READ_CHUNK = 65536
#: the longest the accepting thread waits between looks at the stop signals (the wakeup pipe wakes it sooner)
SIGNAL_CHECK_MS = 200
POLL_INTERVAL_S = 0.005  # only used when os.pidfd_open is unavailable (python < 3.9 or kernel < 5.3)
# After the main process exits, read at most this much more: a background process that keeps writing
# into the inherited pipes must not keep the response from coming back.
DRAIN_LIMIT_BYTES = 16 * 1024 * 1024
# A fork or thread start that fails with EAGAIN is retried this long: right after a process tree is killed at its
# deadline, its processes hold their slots under the container's pids limit until they are reaped.
PIDS_RETRY_S = 1.0
REFUSE_READ_TIMEOUT_S = 1.0  # reading a request the executor has no thread for blocks the accept loop this long
CGROUP_V2_EVENTS = "/sys/fs/cgroup/memory.events"
CGROUP_V1_OOM_CONTROL = "/sys/fs/cgroup/memory/memory.oom_control"
MAX_TAG_CHARS = 256
# how an op this executor does not know is answered; brokers tell an older executor by it, so it never changes
UNKNOWN_OP = "op: unknown operation"
# cpus sent for tags that never run (their action was cancelled before its command started) must not pile up.
MAX_REMEMBERED_TAGS = 4096
# A thread or process started during a re-pin pass by a member not re-pinned yet inherits the old mask: sweep
# again until a pass finds nothing new, at most this many passes.
PIN_PASSES = 5
# A reap between commands sweeps the process table until a pass finds nothing left, at most this many passes (a
# fork bomb forks while it is swept; the sandbox's pids limit bounds what each pass finds).
REAP_PASSES = 20
# In the environment of a background run's processes, inherited by what they start (unless they clear their
# environment): the reap between commands spares them. A command could set it itself, and so keep only its own
# processes, under the sandbox's pids limit.
BACKGROUND_VARIABLE = "TANGRAM_BACKGROUND"
# A process in the middle of an exec reads as having no environment: the reap reads such a process again this much
# later before it decides the process carries no mark (a command that cleared its environment costs a pass this).
EXEC_SETTLE_S = 0.05
BACKGROUND_MARK = BACKGROUND_VARIABLE.encode() + b"=1"

_HEADER = struct.Struct(">I")
# the elastic pytest runner's directory, shipped beside this file (sandboxes/pytest_runner)
RUNNER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytest_runner")


class ClientGone(Exception):
    """The client closed the connection while its command ran; the process tree has been killed."""


class RequestError(Exception):
    """A request the executor cannot run (bad field, missing cwd, argv[0] not found, ...)."""


# ------------------------------------------------------------------------------------------------------------
# Child tracking. Every live child is registered so that SIGTERM can kill it and so that, when the executor is
# PID 1 of its container, the orphan reaper never reaps a child a worker thread is about to wait for.
# ------------------------------------------------------------------------------------------------------------

_children_lock = threading.Lock()
_children = {}  # type: dict
_connections = set()  # type: set  # open client sockets, shut down on SIGTERM
_reaper_enabled = False
# pids a reap between commands leaves alive besides PID 1 and this executor; None: no reaping (not in a container)
_reap_keep = None  # type: frozenset | None
_background = []  # type: list  # background runs started by this executor, waited for once they end


def _register(proc):
    _children[proc.pid] = proc


def _unregister(pid):
    _children.pop(pid, None)


# ------------------------------------------------------------------------------------------------------------
# Tagged commands. A malleable action's cores change while its command runs: the broker re-pins the command by
# its tag. Worker threads share these maps, so every access holds _tags_lock.
# ------------------------------------------------------------------------------------------------------------

_tags_lock = threading.Lock()
_tag_pids = {}  # type: dict  # tag -> pid of the running command
_tag_cpus = collections.OrderedDict()  # type: collections.OrderedDict  # tag -> latest cpus asked for, oldest first


def _remember_cpus(tag, cpus):
    """Record the tag's latest cpus (under _tags_lock), dropping the oldest tags beyond MAX_REMEMBERED_TAGS."""
    _tag_cpus[tag] = cpus
    _tag_cpus.move_to_end(tag)
    while len(_tag_cpus) > MAX_REMEMBERED_TAGS:
        _tag_cpus.popitem(last=False)


def _cpus_for(tag, cpus):
    """The cpus a run tagged `tag` starts on: those sent for the tag before it started, else its own."""
    if tag is None:
        return cpus
    with _tags_lock:
        return _tag_cpus.get(tag, cpus)


def _untag(tag, pid):
    """Forget the tag once its command (pid; None: it never started) ends. Must come before the command is
    reaped: a reaped pid can be reused, and a re-pin must never reach a stranger's processes."""
    if tag is None:
        return
    with _tags_lock:
        if _tag_pids.get(tag) == pid:  # a later run with the same tag owns it otherwise
            _tag_pids.pop(tag, None)
            _tag_cpus.pop(tag, None)


# ------------------------------------------------------------------------------------------------------------
# Process tree handling
# ------------------------------------------------------------------------------------------------------------

def _proc_table():
    """pid -> (state, ppid, session) for every process visible in /proc."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # Field 2 is "(comm)" and comm may contain spaces and parentheses: split after the last ')'.
        rest = data[data.rfind(b")") + 2:].split()
        if len(rest) < 4:
            continue
        try:
            table[int(name)] = (rest[0].decode("ascii", "replace"), int(rest[1]), int(rest[3]))
        except ValueError:
            continue
    return table


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tree(pid, table):
    """The command `pid`'s processes in the /proc snapshot `table`: itself, every descendant and every member of
    its session.

    The child was started in a new session, so its session id and process group id equal its pid. A grandchild
    that called setsid (and left the session) is still found through its parent. Processes that daemonised
    before the snapshot (their parent already gone) cannot be attributed and escape.
    """
    children = {}
    for p, (_state, ppid, _sid) in table.items():
        children.setdefault(ppid, []).append(p)
    found = set()
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in found:
            continue
        found.add(p)
        stack.extend(children.get(p, ()))
    found.update(p for p, (_state, _ppid, sid) in table.items() if sid == pid)
    return found


def kill_tree(pid):
    """SIGKILL the child, its process group and its whole tree (see _tree).

    The tree comes from a /proc snapshot taken before anything is killed, so no member is lost when its parent
    dies first. Processes that escape it are the container cgroup's to stop.
    """
    me = os.getpid()
    targets = _tree(pid, _proc_table())
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in targets:
        if p > 1 and p != me:
            _kill(p)
    # A process forked by a not-yet-killed member during the first pass: sweep the session until it is empty.
    for _ in range(3):
        alive = [p for p, (state, _ppid, sid) in _proc_table().items()
                 if sid == pid and state != "Z" and p > 1 and p != me]
        if not alive:
            break
        for p in alive:
            _kill(p)


def pin_tree(pid, cpus):
    """Set the affinity of every thread of every process in the command's tree (see _tree) to `cpus`; returns
    how many processes were re-pinned.

    Affinity is per thread and /proc/<pid>/task lists them. Processes and threads that vanish meanwhile are
    skipped, and so are those the executor may not touch (one that changed its user id). Raises RequestError
    when the kernel refuses the cpus themselves (none of them online or in the sandbox's cpuset).
    """
    me = os.getpid()
    pinned_tids = set()
    pinned_pids = set()
    for _ in range(PIN_PASSES):
        table = _proc_table()
        new = False
        for p in _tree(pid, table):
            if p == me or table.get(p, ("Z",))[0] == "Z":  # gone, or exited: nothing left to move
                continue
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
            except OSError:
                continue
            for tid in tids:
                if tid in pinned_tids:
                    continue
                new = True
                try:
                    os.sched_setaffinity(tid, cpus)
                except (ProcessLookupError, PermissionError):
                    continue
                except OSError as exc:
                    raise RequestError(f"cpus: cannot set affinity to {cpus!r}: {exc.strerror or exc}")
                pinned_tids.add(tid)
                pinned_pids.add(p)
        if not new:
            break
    return len(pinned_pids)


def _follow(tag, pid, pinned):
    """Re-pin the command tagged `tag` (pid, now on `pinned`; None: unknown) until it is on the tag's latest cpus,
    which another connection may change meanwhile; returns how many processes the last pass re-pinned.

    Each pass holds _tags_lock, so the command cannot be untagged, then reaped and its pid reused, midway."""
    count = 0
    while True:
        with _tags_lock:
            if _tag_pids.get(tag) != pid:  # it ended
                return count
            latest = _tag_cpus.get(tag)
            if latest is None or latest == pinned:
                return count
            count = pin_tree(pid, latest)
        pinned = latest


def _tag_started(tag, pid, cpus):
    """Register the command tagged `tag` as running, and move it onto cpus sent for the tag while it was being
    spawned on `cpus`."""
    with _tags_lock:
        _tag_pids[tag] = pid
    try:
        _follow(tag, pid, cpus)
    except RequestError:
        pass  # cpus no longer in the sandbox: the command keeps those it was spawned on


def set_tag_cpus(request):
    """The "cpus" op: remember the tag's cpus and re-pin its running command's tree onto them."""
    try:
        tag = _check_tag(request.get("tag"), required=True)
        cpus = request.get("cpus")
        if not _is_cpu_list(cpus):
            raise RequestError(f"cpus: must be a non-empty list of non-negative integers, got {cpus!r}")
        with _tags_lock:
            _remember_cpus(tag, cpus)
            pid = _tag_pids.get(tag)
        processes = 0 if pid is None else _follow(tag, pid, None)
    except RequestError as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "processes": processes}


def _reap_orphans():
    """Reap zombies re-parented to us (we are PID 1) that no worker thread waits for."""
    me = os.getpid()
    with _children_lock:
        for p, (state, ppid, _sid) in _proc_table().items():
            if ppid == me and state == "Z" and p not in _children:
                try:
                    os.waitpid(p, os.WNOHANG)
                except ChildProcessError:
                    pass


def _started_at(pid):
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _serving_executor(table):
    """In once mode: the sandbox's serving executor, the oldest child of PID 1 but this process (None: none)."""
    me = os.getpid()
    started = {p: _started_at(p) for p, (_state, ppid, _sid) in table.items() if ppid == 1 and p != me}
    started = {p: t for p, t in started.items() if t is not None}
    return min(started, key=lambda p: (started[p], p)) if started else None


def _other_once_executors(table):
    """Other one-shot executors running in the sandbox (concurrent actions on the engine path)."""
    me = os.getpid()
    found = []
    for p in table:
        if p == me:
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1].endswith(b"executor.py") and argv[2] == b"once":
            found.append(p)
    return found


def wants_reap(request):
    """A run that asked for what it leaves running to be killed after it (and the executor may: ``--reap``)."""
    return (_reap_keep is not None and isinstance(request, dict) and request.get("op", "run") == "run"
            and request.get("reap") is True)


def _environment(pid):
    """The process's environment block: b"" when it has none or an exec is setting it up, None when it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return None


def _background_runs(pids):
    """Those of ``pids`` that belong to a background run: their environment carries BACKGROUND_MARK. An exec fills
    in its new environment's bounds last, so a process caught mid-way (a background shell's child on its way to its
    command) reads as having none: those that read empty are read again once, EXEC_SETTLE_S later."""
    environments = {p: _environment(p) for p in pids}
    unsure = [p for p, environment in environments.items() if environment == b""]
    if unsure:
        time.sleep(EXEC_SETTLE_S)
        environments.update((p, _environment(p)) for p in unsure)
    return {p for p, environment in environments.items() if environment and BACKGROUND_MARK in environment.split(b"\0")}


def reap_leftovers():
    """SIGKILL every process left in the sandbox (daemons, a fork bomb's survivors) unless a command runs: all but
    PID 1, this executor, _reap_keep and the processes of background runs. Passes repeat while something forks;
    returns how many were killed. The caller holds _children_lock, so that no command starts meanwhile.

    Only in a container (``--reap``), where the executor's PID namespace is the sandbox's own."""
    _background[:] = [proc for proc in _background if proc.poll() is None]  # ended ones are waited for
    if _reap_keep is None or _children:  # another command runs: what it started is not left over
        return 0
    killed = set()
    # a background run just started may not have exec'd yet: until it does, its environment is still ours
    keep = {1, os.getpid()} | _reap_keep | {proc.pid for proc in _background}
    for _ in range(REAP_PASSES):
        table = _proc_table()
        if _reap_keep and _other_once_executors(table):
            return len(killed)
        others = [p for p, (state, _ppid, _sid) in table.items() if p not in keep and state != "Z"]
        spared = _background_runs(others)
        alive = [p for p in others if p not in spared]
        if not alive:
            break
        for p in alive:
            _kill(p)
            killed.add(p)
    return len(killed)


def _reaper_loop(stop):
    while not stop.wait(1.0):
        try:
            _reap_orphans()
        except Exception as exc:  # noqa: BLE001 - never let the reaper die on an odd /proc entry
            _log(f"orphan reaper: {exc!r}")


# ------------------------------------------------------------------------------------------------------------
# OOM counter
# ------------------------------------------------------------------------------------------------------------

def resolve_oom_counter(setting):
    """Map --oom-counter to the file holding the cgroup's `oom_kill N` line, or None (detection off)."""
    if setting in (None, "", "none"):
        return None
    if setting == "auto":
        for path in (CGROUP_V2_EVENTS, CGROUP_V1_OOM_CONTROL):
            if read_oom_counter(path) is not None:
                return path
        return None
    return setting


def read_oom_counter(path):
    """The `oom_kill N` value in a memory.events / memory.oom_control file, or None when unreadable."""
    if not path:
        return None
    try:
        with open(path, "r") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0] == "oom_kill":
                    return int(parts[1])
    except (OSError, ValueError):
        return None
    return None


# ------------------------------------------------------------------------------------------------------------
# Running one command
# ------------------------------------------------------------------------------------------------------------

def _empty_response(error=None):
    return {
        "exit_code": None, "signal": None, "timed_out": False, "oom_killed": False,
        "stdout": "", "stderr": "", "stdout_bytes": 0, "stderr_bytes": 0,
        "stdout_truncated": False, "stderr_truncated": False, "duration_s": 0.0, "error": error,
    }


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_cpu_list(value):
    return isinstance(value, list) and bool(value) and all(_is_int(c) and c >= 0 for c in value)


def _check_tag(tag, required):
    """The request's tag (None when absent and not required), or RequestError naming the field."""
    if tag is None and not required:
        return None
    if not isinstance(tag, str) or not tag or len(tag) > MAX_TAG_CHARS:
        raise RequestError(f"tag: must be a non-empty string of at most {MAX_TAG_CHARS} characters, got {tag!r}")
    return tag


def _validate(request):
    """Check the run fields; returns (argv, env, cwd, timeout_s, output_limit, cpus, memory_bytes, tag)."""
    command = request.get("command")
    if isinstance(command, str):
        if not command:
            raise RequestError("command: must not be empty")
        argv = ["/bin/sh", "-c", command]
    elif isinstance(command, list):
        if not command or not all(isinstance(a, str) for a in command):
            raise RequestError("command: a list must be a non-empty list of strings")
        argv = list(command)
    else:
        raise RequestError(f"command: must be a string or a list of strings, got {type(command).__name__}")
    if any("\0" in a for a in argv):
        raise RequestError("command: must not contain NUL characters")

    env = request.get("env")
    if env is None:
        env = {}
    elif not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise RequestError("env: must be an object of string to string")
    elif any(not k or "=" in k or "\0" in k or "\0" in v for k, v in env.items()):
        raise RequestError("env: names must be non-empty without '=' or NUL, values without NUL")

    cwd = request.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd or "\0" in cwd):
        raise RequestError("cwd: must be a non-empty string")

    timeout_s = request.get("timeout_s")
    if timeout_s is not None and (not _is_number(timeout_s) or timeout_s <= 0):
        raise RequestError(f"timeout_s: must be a positive number or null, got {timeout_s!r}")

    output_limit = request.get("output_limit")
    if output_limit is None:
        output_limit = DEFAULT_OUTPUT_LIMIT
    elif not _is_int(output_limit) or output_limit < 0:
        raise RequestError(f"output_limit: must be a non-negative integer, got {output_limit!r}")

    cpus = request.get("cpus")
    if cpus is not None and not _is_cpu_list(cpus):
        raise RequestError(f"cpus: must be a non-empty list of non-negative integers or null, got {cpus!r}")

    memory_bytes = request.get("memory_bytes")
    if memory_bytes is not None and (not _is_int(memory_bytes) or memory_bytes <= 0):
        raise RequestError(f"memory_bytes: must be a positive integer or null, got {memory_bytes!r}")
    tag = _check_tag(request.get("tag"), required=False)
    if request.get("pytest_runner") is True:
        env = _with_runner(env)
    return argv, env, cwd, timeout_s, output_limit, cpus, memory_bytes, tag


def _with_runner(env):
    """The command's environment with the elastic pytest runner importable (its directory, shipped beside this
    file, first on PYTHONPATH): the broker rewrote its ``pytest`` to ``pytest -p tangram_runner``."""
    inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**env, "PYTHONPATH": RUNNER_DIR + (os.pathsep + inherited if inherited else "")}


def _while_pids_full(start, exceptions):
    """``start()``, retried for up to PIDS_RETRY_S while it raises ``exceptions`` (no pid to be had)."""
    deadline = time.monotonic() + PIDS_RETRY_S
    while True:
        try:
            return start()
        except exceptions:
            if time.monotonic() >= deadline:
                raise
            time.sleep(POLL_INTERVAL_S)


def _stdin_of(request):
    """The run's "stdin" (base64) as bytes, or None: the command reads /dev/null."""
    data = request.get("stdin")
    if data is None:
        return None
    if not isinstance(data, str):
        raise RequestError(f"stdin: must be a base64 string or null, got {type(data).__name__}")
    try:
        return base64.b64decode(data.encode("ascii"), validate=True)
    except (ValueError, binascii.Error):
        raise RequestError("stdin: is not valid base64")


def _user_of(request):
    """The run's "user" (a uid, "UID:GID" or a name in this sandbox's /etc/passwd) as (uid, gid, groups, env), or
    None: the command runs as this executor. Only root may run it as anyone else; ``groups`` are a named user's
    supplementary groups (none for ids), ``env`` its HOME, USER and LOGNAME where the passwd database has it."""
    user = request.get("user")
    if user is None:
        return None
    entry = None
    if _is_int(user) and user >= 0:
        uid, gid = user, None
    elif isinstance(user, str) and user.count(":") == 1 and all(p.isdigit() for p in user.split(":")):
        uid, gid = (int(p) for p in user.split(":"))
    elif isinstance(user, str) and user and ":" not in user and "\0" not in user:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise RequestError(f"user: no user {user!r} in the sandbox's /etc/passwd")
        uid, gid = entry.pw_uid, entry.pw_gid
    else:
        raise RequestError(f'user: must be a uid, "UID:GID" or a user name, got {user!r}')
    if entry is None:
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            pass  # any uid may run; one the image does not name gets its own number as its group
    if gid is None:
        gid = uid if entry is None else entry.pw_gid
    if (uid, gid) == (os.geteuid(), os.getegid()):
        return None
    if not _can_switch_users():
        raise RequestError(f"user: the sandbox runs as {os.geteuid()}:{os.getegid()} without the capabilities to "
                           f"change users (CAP_SETUID, CAP_SETGID), and cannot run a command as {uid}:{gid}")
    if sys.version_info < (3, 9):  # noqa: UP036 - the executor runs on any image's python3 >= 3.8
        raise RequestError("user: needs python3 >= 3.9 in the sandbox's image")
    groups = os.getgrouplist(entry.pw_name, gid) if entry is not None and isinstance(user, str) and \
        ":" not in user else []
    env = {} if entry is None else {"HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name}
    return uid, gid, groups, env


def _can_switch_users():
    """Whether this executor may set a child's uid and gid: CAP_SETUID and CAP_SETGID in its effective set (a
    Docker sandbox drops every capability, root's too; an unsandboxed local process as root keeps them)."""
    wanted = (1 << 6) | (1 << 7)  # CAP_SETGID, CAP_SETUID
    try:
        with open("/proc/self/status", "r") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16) & wanted == wanted
    except (OSError, ValueError, IndexError):
        pass
    return False


def _spawn(argv, env, cwd, cpus, memory_bytes, output=subprocess.PIPE, stdin=None, user=None):
    """Start the child in a new session with stdout/stderr to ``output`` (piped) and stdin piped where the run
    has input to feed it (``stdin``), /dev/null otherwise; as ``user`` ((uid, gid, groups, env): _user_of) if given.

    CPU affinity: Linux affinity is per thread and a forked child inherits the forking thread's mask, so this
    thread narrows its own mask around Popen and restores it after. That keeps subprocess on its fast vfork
    path (no preexec_fn) and the mask is in place before exec. RLIMIT_AS is per process, so memory_bytes
    needs a preexec_fn (only the local-process backend uses it; containers use cgroup limits).
    """
    full_env = None
    as_user = {}
    if user is not None:
        uid, gid, groups, user_env = user
        as_user = {"user": uid, "group": gid, "extra_groups": groups}
        env = {**user_env, **env}  # the request's own variables win
    if env:
        full_env = dict(os.environ)
        full_env.update(env)
    preexec = None
    if memory_bytes is not None:
        def preexec():
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    saved_mask = None
    if cpus is not None:
        saved_mask = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            raise RequestError(f"cpus: cannot set affinity to {cpus!r}: {exc.strerror or exc}")
    def start():
        with _children_lock:  # never held while waiting: the reapers free pids
            started = subprocess.Popen(argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                       stdout=output, stderr=output, cwd=cwd, env=full_env,
                                       start_new_session=True, close_fds=True, preexec_fn=preexec,  # noqa: PLW1509
                                       **as_user)
            _register(started)
            return started

    try:
        proc = _while_pids_full(start, BlockingIOError)
    except BlockingIOError:
        raise RequestError("spawn failed: the sandbox is at its pids limit (fork: EAGAIN)")
    except FileNotFoundError as exc:
        if cwd is not None and not os.path.isdir(cwd):
            raise RequestError(f"cwd: directory does not exist: {cwd}")
        raise RequestError("command: executable not found: %s" % (exc.filename or argv[0]))
    except PermissionError as exc:
        if cwd is not None and exc.filename == cwd:  # the user a command runs as may not enter the work dir
            who = "" if user is None else f" to user {user[0]}:{user[1]}"
            raise RequestError(f"cwd: permission denied{who}: {cwd} (give a cwd it may enter, e.g. /tmp)")
        raise RequestError("command: permission denied: %s" % (exc.filename or argv[0]))
    except NotADirectoryError:
        raise RequestError(f"cwd: not a directory: {cwd}")
    except subprocess.SubprocessError as exc:
        raise RequestError(f"spawn failed (memory_bytes={memory_bytes!r}): {exc}")
    except OSError as exc:
        raise RequestError(f"spawn failed: {exc}")
    finally:
        if saved_mask is not None:
            try:
                os.sched_setaffinity(0, saved_mask)
            except OSError:  # the allowed set changed meanwhile (cpuset update): widen; the kernel clips to it
                try:
                    os.sched_setaffinity(0, range(max(os.cpu_count() or 1, max(saved_mask) + 1)))
                except OSError:
                    pass
    return proc


def _exited(pid):
    """True once the child has exited. It is left unreaped, like a pidfd wakeup leaves it, so that its pid is not
    reused before the command's tag is dropped (see _untag)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


class _Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest; a streaming run's `progress` (_Progress) sends
    each kept piece on to the client as it is read, so what is streamed never exceeds the limit either."""

    __slots__ = ("fd", "kept", "limit", "name", "progress", "total")

    def __init__(self, fd, limit, name, progress=None):
        self.fd = fd
        self.limit = limit
        self.name = name
        self.progress = progress
        self.kept = bytearray()
        self.total = 0

    def feed(self, data):
        self.total += len(data)
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += data[:room]
            if self.progress is not None:
                self.progress.send(self.name, data[:room])

    def read(self):
        """One non-blocking read: True while the pipe may give more, False at EOF."""
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        self.feed(data)
        return True

    def drain(self, budget):
        """Read what is already in the pipe without waiting; returns the remaining byte budget."""
        while budget > 0:
            try:
                data = os.read(self.fd, READ_CHUNK)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            self.feed(data)
            budget -= len(data)
        return budget


class _Progress:
    """A streaming run's output frames ({"stream": "stdout"|"stderr", "payload": N} and N raw bytes), sent on the
    client's connection before the answer. A send that fails means the client went away: `gone` is set and the
    command is killed as for a hang-up."""

    __slots__ = ("gone", "sock")

    def __init__(self, sock):
        self.sock = sock
        self.gone = False

    def send(self, name, data):
        if self.gone:
            return
        try:
            _send(self.sock, {"stream": name, "payload": data})
        except OSError:
            self.gone = True


class _Feed:
    """Writes a run's stdin to the command's pipe as the pipe takes it, then closes it (EOF)."""

    __slots__ = ("data", "fd", "pipe", "sent")

    def __init__(self, pipe, data):
        self.pipe = pipe
        self.fd = pipe.fileno()
        self.data = memoryview(data)
        self.sent = 0
        os.set_blocking(self.fd, False)

    def write(self):
        """One non-blocking write: True while there is more to write, False once all is written or the command
        stopped reading (EPIPE); the caller then unregisters and closes the pipe, which is the command's EOF."""
        try:
            self.sent += os.write(self.fd, self.data[self.sent:self.sent + READ_CHUNK])
        except BlockingIOError:
            return True
        except OSError:
            self.sent = len(self.data)
        return self.sent < len(self.data)


def _client_closed(sock):
    """True when the client hung up; a pipelined request (data) is left in the socket for later."""
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return not data


def run_command(request, cancel_sock=None, oom_counter=None):
    """Run one `run` request and return the response dict.

    Request fields: command (str: via /bin/sh -c; list: argv), env (added to the executor's environment),
    cwd, timeout_s (null: none), output_limit (per stream, default 1 MiB), cpus (affinity, null: inherit),
    memory_bytes (RLIMIT_AS, null: none), background (start_background), tag (names the command for the "cpus"
    op; cpus already sent for the tag replace the request's; a run with the tag of a running command takes the tag
    over), reap (what the command left running is killed once its answer is sent: wants_reap, reap_leftovers),
    pytest_runner (_with_runner), stdin (base64, written to the command's stdin and then closed; null: /dev/null),
    user (a uid, "UID:GID" or a user name of the sandbox: _user_of; null: this executor's user), stream (true: each
    piece of kept output goes to the client as it is read, in frames before the answer: _Progress; served mode only,
    ignored in once mode). cancel_sock: the client's socket; if it closes while the command runs, the tree
    is killed and ClientGone is raised. oom_counter: path of the cgroup file with `oom_kill N`.
    Errors of the executor itself come back in "error" with the other fields empty; it never raises for them.
    """
    start = time.monotonic()
    try:
        argv, env, cwd, timeout_s, output_limit, cpus, memory_bytes, tag = _validate(request)
        stdin, user = _stdin_of(request), _user_of(request)
        if request.get("background", False) is not False:
            if stdin is not None:
                raise RequestError("stdin: a background run is answered before it reads; not with background")
            return start_background(request, argv, env, cwd, cpus, memory_bytes, start, user)
    except RequestError as exc:
        return _empty_response(str(exc))
    try:
        if cwd is not None and not os.path.isdir(cwd):
            raise RequestError(f"cwd: directory does not exist: {cwd}")
        oom_before = read_oom_counter(oom_counter)
        cpus = _cpus_for(tag, cpus)
        proc = _spawn(argv, env, cwd, cpus, memory_bytes, stdin=stdin, user=user)
    except RequestError as exc:
        _untag(tag, None)
        return _empty_response(str(exc))

    progress = _Progress(cancel_sock) if cancel_sock is not None and request.get("stream") is True else None
    out = _Capture(proc.stdout.fileno(), output_limit, "stdout", progress)
    err = _Capture(proc.stderr.fileno(), output_limit, "stderr", progress)
    timed_out = False
    cancelled = False
    sel = selectors.DefaultSelector()
    pidfd = None
    try:
        if tag is not None:
            _tag_started(tag, proc.pid, cpus)
        for cap in (out, err):
            os.set_blocking(cap.fd, False)
            sel.register(cap.fd, selectors.EVENT_READ, cap)
        if stdin is not None:
            feed = _Feed(proc.stdin, stdin)
            sel.register(feed.fd, selectors.EVENT_WRITE, feed)
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(proc.pid)
                sel.register(pidfd, selectors.EVENT_READ, "exit")
            except OSError:
                pidfd = None
        if cancel_sock is not None:
            sel.register(cancel_sock, selectors.EVENT_READ, "client")
        deadline = None if timeout_s is None else start + timeout_s
        exited = False
        while not exited:
            wait = None
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    timed_out = True
                    break
            if pidfd is None:
                wait = POLL_INTERVAL_S if wait is None else min(wait, POLL_INTERVAL_S)
            for key, _mask in sel.select(wait):
                source = key.data
                if source == "exit":
                    exited = True
                elif source == "client":
                    if _client_closed(cancel_sock):
                        cancelled = True
                    else:  # a pipelined request: stop watching, it is read after this response
                        sel.unregister(cancel_sock)
                elif isinstance(source, _Feed):
                    if not source.write():
                        sel.unregister(source.fd)
                        source.pipe.close()
                elif not source.read():
                    sel.unregister(source.fd)
            if progress is not None and progress.gone:
                cancelled = True
            if cancelled:
                break
            if pidfd is None and _exited(proc.pid):
                exited = True
        if timed_out or cancelled:
            kill_tree(proc.pid)
        budget = DRAIN_LIMIT_BYTES
        for cap in (out, err):
            budget = cap.drain(budget)
        _untag(tag, proc.pid)
        returncode = proc.wait()
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
        if proc.stdin is not None:
            proc.stdin.close()
        if proc.returncode is None:  # an unexpected exception above: leave nothing running
            _untag(tag, proc.pid)
            kill_tree(proc.pid)
            proc.wait()
        _unregister(proc.pid)
    if cancelled:
        raise ClientGone()

    response = _empty_response()
    if returncode < 0:
        response["signal"] = -returncode
    else:
        response["exit_code"] = returncode
    oom_after = read_oom_counter(oom_counter)
    if (oom_before is not None and oom_after is not None and oom_after > oom_before and not timed_out
            and (returncode == -signal.SIGKILL or returncode == 128 + signal.SIGKILL)):
        response["oom_killed"] = True
    response.update(
        timed_out=timed_out,
        stdout=out.kept.decode("utf-8", "replace"),
        stderr=err.kept.decode("utf-8", "replace"),
        stdout_bytes=out.total,
        stderr_bytes=err.total,
        stdout_truncated=out.total > len(out.kept),
        stderr_truncated=err.total > len(err.kept),
        duration_s=time.monotonic() - start,
    )
    return response


def start_background(request, argv, env, cwd, cpus, memory_bytes, start, user=None):
    """Start a run with "background": true and answer at once with its pid (in the sandbox; also its process
    group's and session's, so killing that group ends it with what it started): it keeps running, its output discarded,
    until it ends, a later command kills it, or the sandbox goes. Only where a reap can end it with the sandbox
    (--reap): elsewhere (local processes) it would outlive its environment."""
    if request["background"] is not True:
        raise RequestError(f"background: must be true or false, got {request['background']!r}")
    if _reap_keep is None:
        raise RequestError("background: needs a container sandbox; on local processes it would outlive its "
                           "environment")
    if cwd is not None and not os.path.isdir(cwd):
        raise RequestError(f"cwd: directory does not exist: {cwd}")
    proc = _spawn(argv, {**env, BACKGROUND_VARIABLE: "1"}, cwd, cpus, memory_bytes, subprocess.DEVNULL, user=user)
    _unregister(proc.pid)  # not a running command: the reap after each command spares it by its mark
    _background.append(proc)
    response = _empty_response()
    response.update(exit_code=0, pid=proc.pid, duration_s=time.monotonic() - start)
    return response


def handle_request(request, cancel_sock=None, oom_counter=None):
    """Dispatch one decoded request; never raises except ClientGone."""
    if not isinstance(request, dict):
        return _empty_response("request: must be a JSON object")
    op = request.get("op", "run")
    if op == "ping":
        return {"ok": True, "pid": os.getpid(), "python": platform.python_version(),
                "protocol": PROTOCOL_VERSION}
    if op == "run":
        try:
            return run_command(request, cancel_sock, oom_counter)
        except ClientGone:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the executor down
            return _empty_response(f"executor internal error: {exc!r}")
    if op == "cpus":
        try:
            return set_tag_cpus(request)
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the executor down
            return {"ok": False, "error": f"executor internal error: {exc!r}"}
    if op in ("write", "read"):
        try:
            return executor_files.handle(request)
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the executor down
            return {"ok": False, "code": "file_io", "error": f"executor internal error: {exc!r}"}
    return _empty_response(f"{UNKNOWN_OP} {op!r} (expected 'run', 'cpus', 'write', 'read' or 'ping')")


# ------------------------------------------------------------------------------------------------------------
# serve mode
# ------------------------------------------------------------------------------------------------------------

def _log(message):
    try:
        sys.stderr.write(f"executor[{os.getpid()}]: {message}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001, S110 - a closed stderr must not stop the executor
        pass


def _recv_exact(sock, n):
    """n bytes (a bytearray, received in place: a payload of MiBs is not copied), or None when the peer closed
    before sending them."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        count = sock.recv_into(view[got:], min(n - got, 1 << 20))
        if not count:
            return None
        got += count
    return buf


def _encode(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _send(sock, obj):
    """One answer frame; an answer's bytes "payload" follows its JSON raw, its length in the JSON's "payload"."""
    payload = obj.get("payload") if isinstance(obj, dict) else None
    if isinstance(payload, (bytes, bytearray)):
        obj = dict(obj, payload=len(payload))
    body = _encode(obj)
    sock.sendall(_HEADER.pack(len(body)) + body)
    if isinstance(payload, (bytes, bytearray)):
        sock.sendall(payload)


class BadFrame(Exception):
    """A request not read whole (too large, or a payload it does not count): where the next frame starts is
    unknown, so it is answered with this message and the connection is closed."""


def _read_request(conn):
    """One request with its payload: (request, None), (None, refusal) for one whose JSON does not parse, or None
    when the peer closed first; raises BadFrame. A request's "payload" (a count of bytes) says that many raw bytes
    follow its JSON; they replace the count, and the frame and they together are bounded by MAX_REQUEST_BYTES."""
    header = _recv_exact(conn, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_REQUEST_BYTES:
        raise BadFrame(f"request: {length} bytes exceeds the {MAX_REQUEST_BYTES} byte limit")
    body = _recv_exact(conn, length)
    if body is None:
        return None
    try:
        request = json.loads(body.decode("utf-8"))
    except ValueError as exc:
        return None, _empty_response(f"request: invalid JSON: {exc}")
    payload = request.get("payload") if isinstance(request, dict) else None
    if payload is not None:
        if not isinstance(payload, int) or isinstance(payload, bool) or payload < 0:
            raise BadFrame("payload: must be a count of bytes")
        if length + payload > MAX_REQUEST_BYTES:
            raise BadFrame(f"request: {length} bytes and a payload of {payload} exceed the {MAX_REQUEST_BYTES} "
                           f"byte limit")
        request["payload"] = _recv_exact(conn, payload)
        if request["payload"] is None:
            return None
    return request, None


def _serve_connection(conn, oom_counter):
    _connections.add(conn)
    try:
        while True:
            try:
                read = _read_request(conn)
            except BadFrame as error:
                _send(conn, _empty_response(str(error)))
                return
            if read is None:
                return
            request, refusal = read
            if refusal is not None:
                _send(conn, refusal)
                continue
            try:
                response = handle_request(request, conn, oom_counter)
            except ClientGone:
                return
            if wants_reap(request):
                with _children_lock:  # the answer goes out first; no command starts before the sweep is done
                    _send(conn, response)
                    reap_leftovers()
                continue
            _send(conn, response)
    except OSError:
        return  # the client went away mid-response; nothing to tell anyone
    finally:
        _connections.discard(conn)
        try:
            conn.close()
        except OSError:
            pass


def _refuse(conn, message):
    """Answer one connection's request with an error instead of running it, and close it. The request is read
    first: closing a unix socket with unread data resets it, and the client would see no answer at all."""
    try:
        conn.settimeout(REFUSE_READ_TIMEOUT_S)
        try:
            _read_request(conn)
        except BadFrame:
            pass
        _send(conn, _empty_response(message))
    except OSError:
        pass
    finally:
        conn.close()


#: the signals that asked the executor to stop (SIGTERM, SIGINT), in the order they came
_stop_signals = []  # type: list


def _on_term(signum, frame):
    """Note the stop; the accepting loop ends at its next wake. Raising here instead lost the stop: the handler can
    run inside ``threading``'s own code (a thread's start waits on a lock), whose cleanup then fails with another
    error that replaces it."""
    _stop_signals.append(signum)


def _wake_on_signals():
    """A pipe the interpreter writes a byte to when a signal arrives, returned as its read end: the accepting thread
    waits on it beside the listener, so a signal the kernel delivered to a connection's thread wakes it too."""
    read_end, write_end = os.pipe()
    for fd in (read_end, write_end):
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    return read_end


def _drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def serve(socket_path, oom_setting, reap=False):
    global _reaper_enabled, _reap_keep
    if reap:
        _reap_keep = frozenset()
    oom_counter = resolve_oom_counter(oom_setting)
    try:
        os.unlink(socket_path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket file is never, even briefly, reachable by others
    try:
        listener.bind(socket_path)
    finally:
        os.umask(old_umask)
    try:
        os.chmod(socket_path, 0o600)
    except OSError:  # gVisor's host-backed socket refuses it; the umask made it 0600 already
        pass
    listener.listen(4096)  # the kernel clips to net.core.somaxconn; a burst must not overflow it
    stop = threading.Event()
    if os.getpid() == 1:
        _reaper_enabled = True
        threading.Thread(target=_reaper_loop, args=(stop,), name="reaper", daemon=True).start()
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    woken = _wake_on_signals()
    waiting = select.poll()
    for fd in (listener.fileno(), woken):
        waiting.register(fd, select.POLLIN)
    reaper = "on" if _reaper_enabled else "off"
    _log(f"serving on {socket_path} (python {platform.python_version()}, oom counter: {oom_counter or 'off'}, "
         f"orphan reaper: {reaper})")
    try:
        while not _stop_signals:
            ready = {fd for fd, _event in waiting.poll(SIGNAL_CHECK_MS)}
            if woken in ready:
                _drain(woken)
            if listener.fileno() not in ready or _stop_signals:
                continue
            try:
                conn, _addr = listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    _log(f"accept: {exc}")
                    time.sleep(0.05)  # out of descriptors: back off instead of spinning
                    continue
                raise
            worker = threading.Thread(target=_serve_connection, args=(conn, oom_counter), daemon=True)
            try:
                _while_pids_full(worker.start, RuntimeError)
            except RuntimeError as exc:  # still no thread to be had: the sandbox is at its pids limit
                _refuse(conn, f"executor: cannot serve the request ({exc}): the sandbox is at its pids limit")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        listener.close()
        try:
            os.unlink(socket_path)
        except OSError:
            pass
        # Clients see the connection drop (ExecutorUnavailable), not a result: their sandbox went away. The
        # shutdown also wakes each worker's select as a client hang-up, which kills its command's tree;
        # the sweep below does the same from here in case a worker is slower than our exit.
        for conn in list(_connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for pid in list(_children):
            kill_tree(pid)
        _log("stopped")
    return 0


# ------------------------------------------------------------------------------------------------------------
# once mode (through `docker exec` for remote Docker engines)
# ------------------------------------------------------------------------------------------------------------

def decode_once(argument):
    """Base64 (urlsafe or standard, padding optional) JSON request -> dict."""
    text = argument.strip()
    text += "=" * (-len(text) % 4)
    return json.loads(base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8"))


def once(argument, oom_setting, reap=False):
    global _reap_keep
    if reap:
        server = _serving_executor(_proc_table())
        _reap_keep = frozenset() if server is None else frozenset({server})
    request = None
    try:
        request = decode_once(argument)
        if isinstance(request, dict) and isinstance(request.get("payload"), str):  # no raw bytes in argv: base64
            request["payload"] = base64.b64decode(request["payload"], validate=True)
    except (ValueError, binascii.Error, UnicodeError) as exc:
        response = _empty_response(f"request: cannot decode base64 JSON argument: {exc}")
    else:
        response = handle_request(request, None, resolve_oom_counter(oom_setting))
    if isinstance(response.get("payload"), (bytes, bytearray)):  # nor on stdout: base64 in the JSON
        response["payload"] = base64.b64encode(response["payload"]).decode("ascii")
    sys.stdout.buffer.write(_encode(response) + b"\n")  # bytes: stdout's encoding may be ASCII in an image
    sys.stdout.flush()
    if wants_reap(request):
        with _children_lock:
            reap_leftovers()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description="ARL-Tangram in-sandbox command executor")
    sub = parser.add_subparsers(dest="mode")
    p_serve = sub.add_parser("serve", help="serve requests on a unix socket")
    p_serve.add_argument("--socket", required=True)
    p_serve.add_argument("--oom-counter", default="none", help="auto, none, or a file with an `oom_kill N` line")
    p_serve.add_argument("--egress", metavar="PORT:SOCKET", help="relay 127.0.0.1:PORT to the egress proxy's socket")
    p_once = sub.add_parser("once", help="run one base64 JSON request and print the JSON response")
    p_once.add_argument("request")
    p_once.add_argument("--oom-counter", default="none")
    for mode in (p_serve, p_once):
        mode.add_argument("--reap", action="store_true",
                          help="in a container only: after a run asking for it, kill every process left in it")
    args = parser.parse_args(argv)
    if args.mode == "serve":
        if args.egress:
            egress_relay.start(args.egress)
        return serve(args.socket, args.oom_counter, args.reap)
    if args.mode == "once":
        return once(args.request, args.oom_counter, args.reap)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
