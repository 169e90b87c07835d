"""Sandbox hardening, each promise proved from inside a sandbox through a live broker's real ``exec`` path.

Commands run as an unprivileged user (uid 1000 unless ``cpu.sandbox_user`` says otherwise), with every capability
dropped, ``no-new-privileges``, no network, a pids limit and a memory limit; as root of the container (the option
``sandbox_user = "root"``) they are no better off, so what root could do elsewhere fails here. Where the per-action
path could change what a command gets (the executor socket on a local engine vs ``docker exec`` of the executor), a
test runs on both: ``fast`` is engine 0 with the fast path, ``engine`` is engine 1 without it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from typing import Any

import docker
import psutil
import pytest

from sandboxes.backend import LABEL_BROKER, LABEL_TRAJECTORY, SandboxError
from tangram.config import parse_config
from tangram.core.errors import ConfigError
from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import Live, live_broker

PATHS = ("fast", "engine")
PIDS_LIMIT = 64
#: every action's cwd is the work dir; files given at creation land there
WORKDIR = "/workspace"


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


def config_for(path: str, **cpu: Any) -> dict[str, Any]:
    """One node of two cores on the engine standing for ``path``, plus top-level ``cpu`` keys."""
    engine = docker_engines()[0 if path == "fast" else 1]
    node = {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 2048, "fast_path": path == "fast"}
    return cpu_config({"n1": node}, **cpu)


def exec_body(command: str, trajectory: str = "traj-1", **spec: Any) -> dict[str, Any]:
    return {"task": "hardening", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": command, **spec}}


async def run(live: Live, command: str, trajectory: str = "traj-1", timeout_s: float = 60, **spec: Any) -> Any:
    status, record = await live.call("POST", "/v1/actions?wait=true",
                                     json={**exec_body(command, trajectory, **spec), "timeout_s": timeout_s})
    assert status == 200, record
    return record


async def stdout_of(live: Live, command: str, **spec: Any) -> str:
    record = await run(live, command, **spec)
    assert record["state"] == "succeeded" and record["result"]["exit_code"] == 0, record
    return record["result"]["stdout"]


def python(source: str, *args: str) -> str:
    """A shell command running ``source`` with the sandbox's python3."""
    return " ".join(shlex.quote(part) for part in ("python3", "-c", source, *args))


def report(stdout: str) -> dict[str, Any]:
    """The JSON object a probe printed as its last line."""
    return json.loads(stdout.strip().splitlines()[-1])


# -- network ----------------------------------------------------------------------------------------------------

CONNECT_PROBE = """
import errno, json, socket, sys
targets = json.loads(sys.argv[1])
with open("/proc/net/dev") as f:
    interfaces = [line.split(":")[0].strip() for line in f.readlines()[2:]]
outcomes = {}
for host, port in targets:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect((host, port))
        outcomes[f"{host}:{port}"] = "connected"
    except socket.timeout:
        outcomes[f"{host}:{port}"] = "timeout"
    except OSError as e:
        outcomes[f"{host}:{port}"] = errno.errorcode[e.errno]
    finally:
        s.close()
print(json.dumps({"interfaces": interfaces, "outcomes": outcomes}))
"""


@pytest.mark.parametrize("path", PATHS)
async def test_no_network_only_loopback_and_every_connection_fails_at_once(path, db):
    """Only ``lo`` exists, so the internet, the host's own addresses and the Docker API's TCP ports are unreachable
    (ENETUNREACH at connect, no timeout), and 127.0.0.1 is the sandbox's own loopback, not the broker's."""
    host_addresses = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                             if a.family.name == "AF_INET" and not a.address.startswith("127.")})
    assert host_addresses, "this host has no non-loopback IPv4 address to aim at"
    async with live_broker(config_for(path), db) as live:
        broker_port = int(live.url.rsplit(":", 1)[1])
        remote = [("1.1.1.1", 53), *((a, p) for a in host_addresses for p in (broker_port, 2375, 2376))]
        targets = [*remote, ("127.0.0.1", broker_port)]
        probe = report(await stdout_of(live, python(CONNECT_PROBE, json.dumps(targets))))
    assert probe["interfaces"] == ["lo"]
    assert probe["outcomes"] == {**{f"{h}:{p}": "ENETUNREACH" for h, p in remote},
                                 f"127.0.0.1:{broker_port}": "ECONNREFUSED"}


# -- privileges -------------------------------------------------------------------------------------------------

#: each needs a capability or a privilege gain the sandbox must not have; all must fail
PRIVILEGED = {
    "chown": "touch owned && chown nobody owned",  # CAP_CHOWN
    "mount": "mount -t tmpfs none /mnt",  # CAP_SYS_ADMIN (mount is setuid root: no-new-privileges)
    "clock": "date -s @0",  # CAP_SYS_TIME
    "raw_socket": python("import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)"),
    "su": "su -s /bin/sh nobody -c true",  # setuid root helper: CAP_SETUID/CAP_SETGID
    "user_namespace": "unshare --user --map-root-user true",  # no new capabilities from a user namespace
    "mknod": "mknod /tmp/disk b 8 0",  # CAP_MKNOD: no block device of the host's disks
}
STATUS_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")


@pytest.mark.parametrize(("path", "user"), [("fast", None), ("engine", None), ("fast", "root")])
async def test_no_capabilities_or_new_privileges_as_the_sandbox_user_or_root(path, user, db):
    """The command is the sandbox user (uid 1000 by default; root when configured) with all five capability sets
    empty and NoNewPrivs set, and every operation that needs a capability (or a setuid binary, or a user namespace
    to regain one) fails with a permission error."""
    uid = "0" if user == "root" else "1000"
    probes = "".join(f"{{ {command}; }} >/dev/null 2>&1; echo {name}=$?\n" for name, command in PRIVILEGED.items())
    config = config_for(path, **({"sandbox_user": user} if user else {}))
    async with live_broker(config, db) as live:
        out = await stdout_of(live, f"id -u; grep -E '^({'|'.join(STATUS_FIELDS)}):' /proc/self/status\n{probes}"
                                    "stat -c owner=%u owned")
    lines = out.splitlines()
    assert lines[0] == uid, "commands run as the sandbox user"
    status = dict(line.split(":\t") for line in lines[1:1 + len(STATUS_FIELDS)])
    assert status == {**{field: "0000000000000000" for field in STATUS_FIELDS[:-1]}, "NoNewPrivs": "1"}
    exit_codes = dict(line.split("=") for line in lines[1 + len(STATUS_FIELDS):])
    assert exit_codes.pop("owner") == uid, "chown must not have changed the file's owner"
    assert set(exit_codes) == set(PRIVILEGED)
    assert [name for name, code in exit_codes.items() if code == "0"] == []


# -- pids limit -------------------------------------------------------------------------------------------------

FORK_BOMB = """
import errno, json, os, time
# tangram-fork-bomb
pids = "/sys/fs/cgroup/pids" if os.path.isdir("/sys/fs/cgroup/pids") else "/sys/fs/cgroup"
forked = 0
while True:
    try:
        child = os.fork()
    except OSError as e:
        refused = errno.errorcode[e.errno]
        break
    if child == 0:
        time.sleep(1000)
        os._exit(0)
    forked += 1
current = int(open(pids + "/pids.current").read())
limit = open(pids + "/pids.max").read().strip()
with open("bomb.json", "w") as f:  # a file, not stdout: partial output is lost if the broker's deadline wins
    json.dump({"forked": forked, "refused": refused, "current": current, "max": limit}, f)
time.sleep(1000)
"""
AFTER_BOMB = """
import json, os
pids = "/sys/fs/cgroup/pids" if os.path.isdir("/sys/fs/cgroup/pids") else "/sys/fs/cgroup"
marker = b"tangram-fork" + b"-bomb"  # split, so this probe's own command line does not match
survivors = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        survivors += marker in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        pass
events = dict(line.split() for line in open(pids + "/pids.events"))
print(json.dumps({"survivors": survivors, "refused_forks": int(events["max"]), "peak": json.load(open("bomb.json"))}))
"""


def pids_in_use(engine: str, broker_id: str, trajectory: str) -> int | None:
    """The engine's count of processes in the trajectory's container (None until the container runs)."""
    client = docker.DockerClient(base_url=engine)
    try:
        found = client.containers.list(filters={"label": [f"{LABEL_BROKER}={broker_id}",
                                                          f"{LABEL_TRAJECTORY}={trajectory}"]})
        if not found:
            return None
        return found[0].stats(stream=False, one_shot=True).get("pids_stats", {}).get("current")
    finally:
        client.close()


async def test_fork_bomb_is_contained_by_the_pids_limit(db):
    """A fork loop runs into ``pids_limit`` (EAGAIN, never more processes than the limit) and holds the sandbox
    there until the action's deadline kills its tree. While it is full, a second action in the same sandbox fails
    with a clear ``exec_error`` (its executor has no thread to spare) instead of taking the sandbox down, the broker
    answers and another trajectory's action runs; afterwards the same sandbox is usable with none of the bomb's
    processes left."""
    config = config_for("fast", pids_limit=PIDS_LIMIT)
    engine, broker_id = config["cpu"]["nodes"]["n1"]["engine"], config["cpu"]["broker_id"]
    async with live_broker(config, db) as live:
        status, bomb = await live.call("POST", "/v1/actions", json={
            **exec_body(python(FORK_BOMB), memory_mb=256), "timeout_s": 6})
        assert status == 201, bomb
        while await asyncio.to_thread(pids_in_use, engine, broker_id, "traj-1") != PIDS_LIMIT:
            _, bomb = await live.call("GET", f"/v1/actions/{bomb['id']}")
            assert bomb["state"] in ("queued", "running"), f"the bomb ended before filling the sandbox: {bomb}"
            await asyncio.sleep(0.1)
        beside = await run(live, "echo beside")
        other = await run(live, "echo other", trajectory="traj-2", memory_mb=128)
        status, health = await live.call("GET", "/healthz")
        assert status == 200, health
        _, bomb = await live.call("GET", f"/v1/actions/{bomb['id']}?wait=true")
        after = report(await stdout_of(live, python(AFTER_BOMB)))
        assert await stdout_of(live, "echo alive") == "alive\n"
    assert beside["state"] == "failed" and beside["error"]["code"] == "exec_error", beside
    assert "pids limit" in beside["error"]["message"], beside
    assert other["state"] == "succeeded" and other["result"]["stdout"] == "other\n", other
    assert other["finished_at"] < bomb["finished_at"], "the other action ran while the bomb held its sandbox full"
    assert bomb["state"] == "timed_out", bomb
    peak = after["peak"]
    assert peak["refused"] == "EAGAIN"
    assert peak["max"] == str(PIDS_LIMIT) and peak["current"] <= PIDS_LIMIT
    assert 0 < peak["forked"] < PIDS_LIMIT
    assert after["survivors"] == 0 and after["refused_forks"] > 0, after


# -- memory limit -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
async def test_memory_bomb_fails_out_of_memory_and_the_environment_survives(path, db):
    """Allocating four times the environment's memory kills the command (``out_of_memory``), not the sandbox:
    the next command in the same environment runs."""
    async with live_broker(config_for(path), db) as live:
        bomb = await run(live, python("b = b'x' * (400 << 20); print(len(b))"), memory_mb=96)
        after = await run(live, "echo alive")
    assert bomb["state"] == "failed" and bomb["error"]["code"] == "out_of_memory", bomb
    assert bomb["error"]["stdout"] == ""
    assert after["state"] == "succeeded" and after["result"]["stdout"] == "alive\n", after
    assert after["result"]["environment"] == bomb["error"]["environment"]


# -- output caps ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
async def test_output_is_capped_per_stream_with_totals(path, db):
    """Each stream keeps exactly ``output_limit`` bytes, says it was truncated and counts every byte written;
    output of exactly the limit is whole and not flagged."""
    noisy = "head -c 100000 /dev/zero | tr '\\0' o; head -c 70000 /dev/zero | tr '\\0' e >&2"
    exact = "head -c 1000 /dev/zero | tr '\\0' o; head -c 1000 /dev/zero | tr '\\0' e >&2"
    async with live_broker(config_for(path), db) as live:
        over = (await run(live, noisy, output_limit=1000))["result"]
        at = (await run(live, exact, output_limit=1000))["result"]
    assert (over["stdout"], over["stdout_bytes"], over["stdout_truncated"]) == ("o" * 1000, 100000, True)
    assert (over["stderr"], over["stderr_bytes"], over["stderr_truncated"]) == ("e" * 1000, 70000, True)
    assert (at["stdout"], at["stdout_bytes"], at["stdout_truncated"]) == ("o" * 1000, 1000, False)
    assert (at["stderr"], at["stderr_bytes"], at["stderr_truncated"]) == ("e" * 1000, 1000, False)


# -- read-only root ---------------------------------------------------------------------------------------------

WRITE_PROBE = """
import errno, json, sys
outcomes = {}
for path in sys.argv[1:]:
    try:
        with open(path, "w") as f:
            f.write("written")
        outcomes[path] = "ok"
    except OSError as e:
        outcomes[path] = errno.errorcode[e.errno]
print(json.dumps(outcomes))
"""
TMP_TEST = """
def test_tmp_path_and_cache_are_writable(tmp_path):
    (tmp_path / "x").write_text("1")
    assert (tmp_path / "x").read_text() == "1"
"""
WRITE_TARGETS = ("/usr/probe", "/etc/probe", "/opt/probe", "/var/tmp/probe", f"{WORKDIR}/probe", "/tmp/probe")


@pytest.mark.parametrize("path", PATHS)
async def test_read_only_root_keeps_workspace_and_a_small_tmp_writable(path, db):
    """With ``cpu.read_only_root`` every write outside the work dir and /tmp fails with EROFS (/var/tmp too, where
    the sandbox user could otherwise write), the work dir is the sandbox user's, the spec's files
    arrive in /workspace, pytest (its cache, tmp_path) works, /tmp is a 64 MiB tmpfs that fills up rather
    than growing, and the executor keeps serving the same environment."""
    files = {"src/given.txt": "from the spec", "test_ro.py": TMP_TEST}
    async with live_broker(config_for(path, read_only_root=True), db) as live:
        writes = report(await stdout_of(live, python(WRITE_PROBE, *WRITE_TARGETS), files=files, memory_mb=256))
        given = await stdout_of(live, "cat src/given.txt")
        tests = await stdout_of(live, "python3 -m pytest -q test_ro.py")
        tmp = await run(live, "grep ' /tmp ' /proc/mounts; dd if=/dev/zero of=/tmp/fill bs=1M count=80")
        kept = await stdout_of(live, f"cat {WORKDIR}/probe; echo; ls -a {WORKDIR}")
    assert writes == {"/usr/probe": "EROFS", "/etc/probe": "EROFS", "/opt/probe": "EROFS", "/var/tmp/probe": "EROFS",
                      f"{WORKDIR}/probe": "ok", "/tmp/probe": "ok"}
    assert given == "from the spec"
    assert "1 passed" in tests
    assert "size=65536k" in tmp["result"]["stdout"]
    assert tmp["result"]["exit_code"] != 0 and "No space left on device" in tmp["result"]["stderr"], tmp
    assert kept.splitlines()[0] == "written"
    assert {".pytest_cache", "probe", "src", "test_ro.py"} <= set(kept.splitlines()[1:])


async def test_root_is_writable_without_the_option(db):
    """The default keeps the image's root writable where the sandbox user may write (read-only root is opt-in), and
    the spec's files arrive in directories the sandbox user owns."""
    async with live_broker(config_for("fast"), db) as live:
        writes = report(await stdout_of(live, python(WRITE_PROBE, "/var/tmp/probe", "/usr/probe", "src/new"),
                                        files={"src/given.txt": "from the spec"}))
        given = await stdout_of(live, "cat src/given.txt; echo; stat -c %u src src/given.txt .")
    assert writes == {"/var/tmp/probe": "ok", "/usr/probe": "EACCES", "src/new": "ok"}
    assert given.splitlines() == ["from the spec", "1000", "1000", "1000"]


def test_read_only_root_config_is_checked():
    """A non-boolean, or a local-process node it cannot protect, stops start-up naming the key."""
    assert parse_config({"cpu": {"read_only_root": True}}).cpu.read_only_root is True
    assert parse_config({}).cpu.read_only_root is False
    with pytest.raises(ConfigError) as bad_value:
        parse_config({"cpu": {"read_only_root": "yes"}})
    assert (bad_value.value.key, bad_value.value.reason) == ("cpu.read_only_root", "must be true or false")
    with pytest.raises(ConfigError) as local_node:
        parse_config({"cpu": {"read_only_root": True, "nodes": {"dev": {"backend": "local"}}}})
    assert local_node.value.key == "cpu.read_only_root" and "'dev'" in local_node.value.reason


# -- Docker socket ----------------------------------------------------------------------------------------------

SOCKET_PROBE = """
import json, os, socket
found = []
for top in os.listdir("/"):
    if top in ("proc", "sys"):
        continue
    for root, dirs, names in os.walk("/" + top):
        for name in dirs + names:
            path = os.path.join(root, name)
            try:
                if os.stat(path, follow_symlinks=False).st_mode & 0o170000 == 0o140000:
                    found.append(path)
            except OSError:
                pass
answers = {}
for path in found:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        s.sendall(b"GET /version HTTP/1.0\\r\\nHost: docker\\r\\n\\r\\n")
        answers[path] = s.recv(64).decode("latin-1")
    except OSError as e:
        answers[path] = type(e).__name__
    finally:
        s.close()
with open("/proc/net/unix") as f:
    unix_paths = sorted({line.split()[-1] for line in f.readlines()[1:] if len(line.split()) > 7})
devices = sorted(os.listdir("/dev"))
block = [d for d in devices if os.path.exists("/dev/" + d) and os.stat("/dev/" + d).st_mode & 0o170000 == 0o060000]
print(json.dumps({"sockets": answers, "unix_paths": unix_paths, "block_devices": block,
                  "docker_host": os.environ.get("DOCKER_HOST")}))
"""


@pytest.mark.parametrize("path", PATHS)
async def test_no_docker_socket_or_host_disk_inside(path, db):
    """No Docker socket exists anywhere in the sandbox: the only unix socket is the executor's own, and it does not
    speak the Docker API; the netns shows no host sockets (containerd's abstract ones included). The host's Docker
    directory is not there, no block device could reach the host's disks, and ``mount`` is refused."""
    executor_socket = "/run/tangram/exec.sock" if path == "fast" else "/tmp/exec.sock"
    async with live_broker(config_for(path), db) as live:
        probe = report(await stdout_of(live, python(SOCKET_PROBE)))
        mounts = await stdout_of(live, "test -e /var/lib/docker; echo docker_dir=$?\n"
                                       "mount --bind / /mnt 2>/dev/null; echo bind=$?\n"
                                       "mount -t proc proc /mnt 2>/dev/null; echo proc=$?")
    assert list(probe["sockets"]) == [executor_socket]
    assert not probe["sockets"][executor_socket].startswith("HTTP/"), probe
    assert probe["unix_paths"] == [executor_socket]
    assert probe["block_devices"] == [] and probe["docker_host"] is None
    assert mounts.splitlines()[0] == "docker_dir=1"
    assert all(line.split("=")[1] != "0" for line in mounts.splitlines()[1:]), mounts


# -- disk and log caps ------------------------------------------------------------------------------------------

async def test_a_sandbox_cannot_fill_the_host_disk_where_the_engine_caps_it(db):
    """On an engine whose storage caps a container's disk (node 2: the btrfs driver, simple quotas), a command that
    writes past ``cpu.disk_mb`` anywhere it may write stops at the cap (the environment goes on); the node says its
    sandboxes are capped. Node 1 (overlay2 on ext4) says they are not."""
    config = config_for("engine", disk_mb=512)
    async with live_broker(config, db) as live:
        fill = await run(live, "head -c 1000000000 /dev/zero > /var/tmp/fill; echo $?; du -m /var/tmp/fill")
        again = await stdout_of(live, "rm /var/tmp/fill; echo alive")
        _, resources = await live.call("GET", "/v1/resources")
    [row] = [r for r in resources["resources"] if r["resource"] == "cpu"]
    status, written = fill["result"]["stdout"].split()[:2]
    assert status == "1" and "Disk quota exceeded" in fill["result"]["stderr"], fill["result"]
    assert 0 < int(written) <= 512, written
    assert again == "alive\n"
    assert row["disk_capped"] is True, row
    async with live_broker(config_for("fast", disk_mb=512), db) as live:
        await stdout_of(live, "true")
        _, resources = await live.call("GET", "/v1/resources")
    assert [r["disk_capped"] for r in resources["resources"] if r["resource"] == "cpu"] == [False]


async def test_what_a_command_writes_to_the_engine_log_is_capped(db):
    """A command that writes into its container's log (the executor's stderr, through /proc/1/fd/2) fills one
    file of at most 1 MiB on the host, not the host's disk."""
    config = config_for("fast")
    engine, broker_id = config["cpu"]["nodes"]["n1"]["engine"], config["cpu"]["broker_id"]
    async with live_broker(config, db) as live:
        await stdout_of(live, "for i in $(seq 50); do head -c 100000 /dev/zero | tr '\\0' x > /proc/1/fd/2; done")
        client = docker.DockerClient(base_url=engine)
        try:
            [container] = client.containers.list(filters={"label": f"{LABEL_BROKER}={broker_id}"})
            log_path = container.attrs["LogPath"]
            size = os.path.getsize(log_path)
        finally:
            client.close()
    assert size <= 1.1 * (1 << 20), size


# -- gVisor -----------------------------------------------------------------------------------------------------

async def test_a_gvisor_node_runs_its_commands_under_gvisor(db):
    """``runtime = "runsc"``: the sandbox's commands see gVisor's kernel, not the host's, and the rest holds there
    too (the sandbox user, a socket directory it cannot write, its leftovers reaped); an engine that does not know
    the runtime stops the node's start, naming it."""
    config = config_for("fast")
    config["cpu"]["nodes"]["n1"]["runtime"] = "runsc"
    async with live_broker(config, db) as live:
        seen = await stdout_of(live, "uname -r; id -u; touch /run/tangram/x 2>/dev/null; echo write=$?; "
                                     "sleep 1000 & echo started")
        left = await stdout_of(live, python("import os; print(sum(p.isdigit() for p in os.listdir('/proc')))"))
    release, uid, write, started = seen.split()
    assert release != os.uname().release and uid == "1000" and write == "write=1" and started == "started", seen
    assert int(left) <= 4, left  # init, the executor, the shell and python3: the sleep is gone
    unknown = config_for("engine")
    unknown["cpu"]["nodes"]["n1"]["runtime"] = "no-such-runtime"
    with pytest.raises(SandboxError, match="no runtime 'no-such-runtime'"):
        async with live_broker(unknown, db):
            pass


# -- the sandbox user per environment ---------------------------------------------------------------------------

async def test_an_environment_chooses_its_sandbox_user(db):
    """``sandbox_user`` with an environment's first action (or ``POST /v1/environments``) sets who runs there, its
    work dir theirs; a later action cannot change it, and a malformed one is a 400 naming the field."""
    async with live_broker(config_for("fast"), db) as live:
        as_root = await stdout_of(live, "id -u; stat -c %u .", sandbox_user="root")
        status, env = await live.call("POST", "/v1/environments", json={
            "task": "hardening", "trajectory": "other", "sandbox_user": "2000:3000", "files": {"a": "x"}})
        assert status == 201 and env["sandbox_user"] == "2000:3000", env
        other = await stdout_of(live, "id -u; id -g; stat -c %u:%g . a", trajectory="other")
        changed = await live.call("POST", "/v1/actions", json=exec_body("true", sandbox_user="1000:1000"))
        malformed = await live.call("POST", "/v1/actions", json=exec_body("true", "t2", sandbox_user="nobody"))
    assert as_root.split() == ["0", "0"]
    assert other.split() == ["2000", "3000", "2000:3000", "2000:3000"]
    for (status, refused), code in ((changed, 422), (malformed, 400)):
        assert status == code and refused["error"]["field"] == "spec.sandbox_user", refused


async def test_a_node_holds_no_more_sandboxes_than_its_pids_budget(db):
    """A node's pids budget over ``pids_limit`` is how many sandboxes it holds: a trajectory beyond waits in the
    queue (and ``POST /v1/environments`` is 429) until one is deleted, then runs there; the room is shown."""
    config = config_for("fast", pids_limit=PIDS_LIMIT)
    config["cpu"]["nodes"]["n1"]["pids"] = 2 * PIDS_LIMIT + PIDS_LIMIT // 2
    async with live_broker(config, db) as live:
        first = await run(live, "true", trajectory="a", memory_mb=64)
        await run(live, "true", trajectory="b", memory_mb=64)
        status, waiting = await live.call("POST", "/v1/actions", json={**exec_body("echo c", "c", memory_mb=64),
                                                                       "timeout_s": 60})
        assert status == 201, waiting
        status, refused = await live.call("POST", "/v1/environments", json={"task": "hardening", "memory_mb": 64})
        _, resources = await live.call("GET", "/v1/resources")
        await asyncio.sleep(1)
        _, still = await live.call("GET", f"/v1/actions/{waiting['id']}")
        assert (await live.call("DELETE", f"/v1/environments/{first['result']['environment']}"))[0] == 200
        _, ran = await live.call("GET", f"/v1/actions/{waiting['id']}?wait=true")
    assert status == 429 and refused["error"]["field"] == "memory_mb", refused
    assert [r["sandbox_room"] for r in resources["resources"] if r["resource"] == "memory_mb"] == [0]
    assert still["state"] == "queued", still
    assert ran["state"] == "succeeded" and ran["result"]["stdout"] == "c\n", ran
