"""The CPU manager on two real Docker engines: allocate-on-execution, elasticity, faults, placement, reaping."""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandboxes.backend import SandboxSpec
from sandboxes.cgroup import ContainerCgroup
from sandboxes.docker import DockerBackend
from sandboxes.exec_wire import ExecRequest
from sandboxes.image import DEFAULT_IMAGE
from tangram.core.action import Kind
from tests.docker_nodes import cpu_config, docker_engines, labelled_containers, new_broker_id
from tests.harness import Live, live_broker

ELASTIC = {"resource": "cpu", "t1": 2.0, "efficiency": {"1": 1.0, "2": 0.9}}


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


def one_node(engine: str, **node: Any) -> dict[str, Any]:
    return cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "numa": ["0", "1"],
                              "memory_mb": 4096, **node}})


def exec_action(command: str, *, trajectory: str | None = "traj-1", cpu: Any = 1, task: str = "t",
                **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"task": task, "kind": "exec", "demand": {"cpu": cpu},
                            "spec": {"command": command, **spec}}
    if trajectory is not None:
        body["trajectory"] = trajectory
    return body


async def run(live: Live, body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    status, record = await live.call("POST", "/v1/actions?wait=true", json={**body, **extra})
    assert status == 200, record
    return record


def allowed(stdout: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in stdout.splitlines() if line.startswith("Cpus_allowed_list"))


async def test_elastic_action_sees_exactly_its_cores_and_idle_sandbox_is_frozen(db):
    engine = docker_engines()[0]
    async with live_broker(one_node(engine), db) as live:
        record = await run(live, exec_action("grep Cpus_allowed_list /proc/self/status; echo n=$TANGRAM_NUM_CPUS "
                                             "p={parallel_num}", cpu={"min": 1, "max": 2}), elasticity=ELASTIC)
        assert record["state"] == "succeeded", record
        cores = record["allocation"]["placement"]["cpu"]["cores"]
        assert cores == [0, 1]  # an empty node: the DP gives the elastic action both cores
        assert allowed(record["result"]["stdout"]) == "0-1"
        assert "n=2 p=2" in record["result"]["stdout"]
        env_id = record["result"]["environment"]
        manager = live.broker.executor[Kind.EXEC]
        env = manager.environments[env_id]
        cgroup: ContainerCgroup = env.sandbox.cgroup
        assert cgroup.freeze.read_text().strip() in ("FROZEN", "FREEZING", "1")  # idle: on no core at all
        # a one-core action in the same environment sees one core only
        record = await run(live, exec_action("grep Cpus_allowed_list /proc/self/status"))
        assert record["result"]["environment"] == env_id
        assert allowed(record["result"]["stdout"]) == str(record["allocation"]["placement"]["cpu"]["cores"][0])
        assert cgroup.cpu_quota.read_text().split()[0] == "100000"  # quota of exactly one core
        assert manager.nodes["n1"].cores.free == {0, 1}  # cores came back


async def test_concurrent_actions_never_share_a_core(db):
    engine = docker_engines()[0]
    async with live_broker(one_node(engine), db) as live:
        command = "sleep 0.4; grep Cpus_allowed_list /proc/self/status"
        bodies = [exec_action(command, trajectory=f"traj-{i}", memory_mb=128) for i in range(6)]
        records = await asyncio.gather(*(run(live, b) for b in bodies))
        spans = []
        for record in records:
            assert record["state"] == "succeeded", record
            cores = record["allocation"]["placement"]["cpu"]["cores"]
            assert allowed(record["result"]["stdout"]) == str(cores[0])
            spans.append((record["started_at"], record["finished_at"], cores[0]))
        overlapping = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1:] if a[0] < b[1] and b[0] < a[1]]
        assert overlapping, "two cores and six actions: some must have run at the same time"
        assert all(a[2] != b[2] for a, b in overlapping)


async def test_pytest_runs_in_parallel_on_the_granted_cores(db):
    engine = docker_engines()[0]
    tests = "import time\n" + "".join(f"def test_{i}():\n    time.sleep(0.3)\n" for i in range(4)) + \
        "def test_long():\n    time.sleep(1.05)\n"
    async with live_broker(one_node(engine), db) as live:
        def body(trajectory: str) -> dict[str, Any]:
            return exec_action("pytest -v -p no:cacheprovider test_sleepy.py", trajectory=trajectory,
                               cpu={"min": 1, "max": 2}, pytest_parallel=True, files={"test_sleepy.py": tests})

        record = await run(live, body("traj-first"), elasticity=ELASTIC)
        assert record["state"] == "succeeded", record
        out = record["result"]["stdout"]
        assert record["result"]["exit_code"] == 0, out
        assert "5 passed" in out and record["result"]["pytest_runner"] == {
            "runner": "tangram", "detail": "2 worker(s) forked after one collection"}, out  # the runner, on 2
        assert re.search(r'^tangram-runner-long-tests: \{"test_sleepy.py::test_long": [0-9.]+\}$', out,
                         re.MULTILINE), out
        again = await run(live, body("traj-again"), elasticity=ELASTIC)  # the same signature: its long test is known
        assert again["result"]["pytest_runner"]["detail"] == (
            "2 worker(s) forked after one collection, 1 long test(s) known from an earlier run"), \
            again["result"]["stdout"]


def runner_processes() -> list[psutil.Process]:
    """The processes of an elastic pytest run on the runner with two workers, seen from the host."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "--tangram-workers=2" in (process.info["cmdline"] or []):
            found.append(process)
    return found


async def test_a_malleable_test_runs_workers_follow_its_cores(db):
    """An elastic pytest run on both cores gives one back to a command that arrives (its workers go down to one)
    and takes it again when that command ends (the runner forks a second worker at once); the record says so."""
    engine = docker_engines()[0]
    suite = ("import time, pytest\n@pytest.mark.parametrize('i', range(200))\ndef test_busy(i):\n"
             "    end = time.monotonic() + 0.04\n    while time.monotonic() < end:\n        pass\n")
    async with live_broker(one_node(engine), db) as live:
        _, elastic = await live.call("POST", "/v1/actions", json={
            **exec_action("python3 -m pytest -q -p no:cacheprovider test_busy.py", cpu={"min": 1, "max": 2},
                          pytest_parallel=True, files={"test_busy.py": suite}),
            "elasticity": {"resource": "cpu", "t1": 8.0, "efficiency": {"1": 1.0, "2": 0.95}}})
        deadline = time.monotonic() + 60
        while len(runner_processes()) < 3:  # its coordinator and two workers: it runs on both cores
            assert time.monotonic() < deadline, "the runner never forked its two workers"
            await asyncio.sleep(0.05)
        holder = await run(live, exec_action("sleep 1", trajectory="holder"))
        _, record = await live.call("GET", f"/v1/actions/{elastic['id']}?wait=true")
        _, metrics = await live.call("GET", "/metrics")
    assert 'tangram_pytest_runs_total{runner="tangram"} 1.0' in metrics
    assert holder["state"] == "succeeded"
    assert record["state"] == "succeeded" and "200 passed" in record["result"]["stdout"], record
    assert record["allocation"]["malleable"]["resizes"] >= 2, record["allocation"]
    assert record["result"]["pytest_runner"]["runner"] == "tangram", record["result"]["stdout"][-500:]
    assert "following the cores: 2 -> 1 -> 2" in record["result"]["pytest_runner"]["detail"], record["result"]


async def test_a_test_run_started_on_one_core_grows_when_the_other_frees(db):
    """A pytest run the runner takes, started on the one free core (a command holds the other), takes the second
    core when that command ends: its workers follow its cores up to its maximum, so the scheduler grows it and the
    runner forks a second worker at once."""
    engine = docker_engines()[0]
    suite = ("import time, pytest\n@pytest.mark.parametrize('i', range(150))\ndef test_busy(i):\n"
             "    end = time.monotonic() + 0.04\n    while time.monotonic() < end:\n        pass\n")
    async with live_broker(one_node(engine), db) as live:
        _, holder = await live.call("POST", "/v1/actions", json=exec_action("sleep 3", trajectory="holder"))
        deadline = time.monotonic() + 60
        while (await live.call("GET", f"/v1/actions/{holder['id']}"))[1]["state"] != "running":
            assert time.monotonic() < deadline, "the holder never started"
            await asyncio.sleep(0.05)
        _, elastic = await live.call("POST", "/v1/actions", json={
            **exec_action("python3 -m pytest -q -p no:cacheprovider test_busy.py", cpu={"min": 1, "max": 2},
                          pytest_parallel=True, files={"test_busy.py": suite}),
            "elasticity": {"resource": "cpu", "t1": 6.0, "efficiency": {"1": 1.0, "2": 0.95}}})
        _, record = await live.call("GET", f"/v1/actions/{elastic['id']}?wait=true")
        _, held = await live.call("GET", f"/v1/actions/{holder['id']}?wait=true")
    assert held["state"] == "succeeded" and record["state"] == "succeeded", record
    assert "150 passed" in record["result"]["stdout"], record["result"]["stdout"][-500:]
    malleable = record["allocation"]["malleable"]
    assert malleable["workers_follow_units"] is True and malleable["workers"] == 2, malleable
    assert [units for _, units in malleable["history"]][:2] == [1, 2], malleable
    assert "following the cores: 1 -> 2" in record["result"]["pytest_runner"]["detail"], record["result"]


async def test_timeout_kills_the_whole_tree_and_the_environment_survives(db):
    engine = docker_engines()[0]
    async with live_broker(one_node(engine), db) as live:
        record = await run(live, exec_action("echo started; sleep 1000 & sleep 1000"), timeout_s=2)
        assert record["state"] == "timed_out", record
        assert record["error"]["code"] == "timed_out"
        assert record["error"]["stdout"] == "started\n"  # partial output comes back
        record = await run(live, exec_action("cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c 'slee[p] 1000' "
                                             "|| true"))
        assert record["result"]["stdout"].strip() == "0", "a sleep of the killed tree survived"


async def test_output_is_capped_with_a_truncation_flag(db):
    engine = docker_engines()[0]
    async with live_broker(one_node(engine), db) as live:
        record = await run(live, exec_action("head -c 100000 /dev/zero | tr '\\0' a; echo err >&2",
                                             output_limit=1000))
        result = record["result"]
        assert len(result["stdout"]) == 1000 and result["stdout_truncated"] is True
        assert result["stdout_bytes"] == 100000
        assert result["stderr"] == "err\n" and result["stderr_truncated"] is False


async def test_memory_bomb_is_reported_as_oom_and_the_environment_stays_usable(db):
    engine = docker_engines()[0]
    async with live_broker(one_node(engine), db) as live:
        bomb = "python3 -c \"b = b'x' * (400 << 20); print(len(b))\""
        record = await run(live, exec_action(bomb, memory_mb=96))
        assert record["state"] == "failed", record
        assert record["error"]["code"] == "out_of_memory", record["error"]
        assert "96 MiB" in record["error"]["message"]
        record = await run(live, exec_action("echo alive"))
        assert record["state"] == "succeeded" and record["result"]["stdout"] == "alive\n"


async def test_idle_environments_are_reaped_after_their_ttl(db):
    engine = docker_engines()[0]
    config = one_node(engine)
    config["cpu"]["idle_ttl_s"] = 1.0
    async with live_broker(config, db) as live:
        status, env = await live.call("POST", "/v1/environments", json={"task": "t", "trajectory": "ttl"})
        assert status == 201, env
        broker_id = config["cpu"]["broker_id"]
        assert len(labelled_containers(engine, broker_id)) == 1
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the record goes first, then the container is removed
            status, _ = await live.call("GET", f"/v1/environments/{env['id']}")
            remaining = labelled_containers(engine, broker_id)
            if status == 404 and not remaining:
                break
            await asyncio.sleep(0.2)
        assert status == 404
        assert remaining == []


async def test_two_nodes_balance_memory_and_keep_trajectory_affinity(db):
    first, second = docker_engines()[:2]
    config = cpu_config({"a": {"backend": "docker", "engine": first, "cores": "0", "memory_mb": 2048},
                         "b": {"backend": "docker", "engine": second, "cores": "1", "memory_mb": 2048}})
    async with live_broker(config, db) as live:
        one = await run(live, exec_action("hostname > /workspace/mark; echo one", trajectory="A", memory_mb=512))
        two = await run(live, exec_action("echo two", trajectory="B", memory_mb=256))
        assert two["state"] == "succeeded", two["error"]
        node_a = one["result"]["node"]
        node_b = two["result"]["node"]
        assert node_a != node_b  # the second trajectory goes to the node with less memory reserved
        for _ in range(3):
            again = await run(live, exec_action("cat /workspace/mark", trajectory="A"))
            assert again["result"]["node"] == node_a
            assert again["result"]["environment"] == one["result"]["environment"]
        engine_of = {"a": first, "b": second}
        broker_id = config["cpu"]["broker_id"]
        assert len(labelled_containers(engine_of[node_a], broker_id)) == 1
        assert len(labelled_containers(engine_of[node_b], broker_id)) == 1
        _, body = await live.call("GET", "/v1/resources")
        memory = {r["pool"]: r["in_use"] for r in body["resources"] if r["resource"] == "memory_mb"}
        assert memory == {node_a: 512, node_b: 256}
    assert labelled_containers(first, broker_id) == [] and labelled_containers(second, broker_id) == []


async def test_engine_path_without_the_fast_path(db):
    engine = docker_engines()[1]
    async with live_broker(one_node(engine, fast_path=False), db) as live:
        record = await run(live, exec_action("grep Cpus_allowed_list /proc/self/status"))
        assert record["state"] == "succeeded", record
        assert allowed(record["result"]["stdout"]) == str(record["allocation"]["placement"]["cpu"]["cores"][0])
        record = await run(live, exec_action("sleep 1000", trajectory="slow"), timeout_s=1.5)
        assert record["state"] == "timed_out"


async def test_environment_endpoint_files_exec_and_delete(db):
    engine = docker_engines()[0]
    config = one_node(engine)
    async with live_broker(config, db) as live:
        status, env = await live.call("POST", "/v1/environments", json={
            "task": "t", "memory_mb": 128, "files": {"src/app.py": "print('hello from app')",
                                                     "data.bin": {"base64": "AAEC"}}})
        assert status == 201, env
        record = await run(live, exec_action("python3 src/app.py; od -An -tx1 data.bin", trajectory=None,
                                             environment=env["id"]))
        assert record["result"]["stdout"].split() == ["hello", "from", "app", "00", "01", "02"]
        status, other = await live.call("POST", "/v1/actions", json=exec_action(
            "true", task="someone-else", trajectory=None, environment=env["id"]))
        assert status == 404 and other["error"]["field"] == "spec.environment"
        status, deleted = await live.call("DELETE", f"/v1/environments/{env['id']}")
        assert status == 200 and deleted["state"] == "destroyed"
        assert labelled_containers(engine, config["cpu"]["broker_id"]) == []
        status, _ = await live.call("GET", f"/v1/environments/{env['id']}")
        assert status == 404


async def test_bad_input_and_unknown_images(db):
    engine = docker_engines()[0]
    config = one_node(engine)
    config["cpu"]["limits"] = {"max_files_bytes": 1000}
    async with live_broker(config, db) as live:
        status, body = await live.call("POST", "/v1/environments", json={"task": "t", "image": "no/such:image"})
        assert status == 422 and body["error"]["field"] == "image" and "no/such:image" in body["error"]["reason"]
        record = await run(live, exec_action("true", image="no/such:image", trajectory="x"))
        assert record["state"] == "failed" and record["error"]["code"] == "image_not_found"
        cases = [
            (exec_action("x" * 70_000), 413, "spec.command"),
            (exec_action("true", files={"big": "x" * 2000}), 413, "spec.files"),
            (exec_action("true", memory_mb=1 << 30, trajectory="huge"), 422, "spec.memory_mb"),
            (exec_action("true", files={"../escape": "x"}), 422, "spec.files.../escape"),
            (exec_action("true", bogus=1), 400, "spec.bogus"),
            ({**exec_action("true"), "demand": {"lease.local": 1}}, 422, "demand.cpu"),
        ]
        for body, expected, field in cases:
            status, answer = await live.call("POST", "/v1/actions", json=body)
            assert (status, answer["error"]["field"]) == (expected, field), answer
        status, body = await live.call("POST", "/v1/environments", json={"task": "t", "memory_mb": 1 << 30})
        assert status == 422 and body["error"]["field"] == "memory_mb"


async def test_an_image_that_is_no_docker_reference_never_reaches_the_engine(db):
    """Found by schemathesis as a 503 (the engine refusing a 256-character reference): the document's grammar and
    bound refuse it with a 400 first. A well-formed reference the engine lacks is still the engine's 422."""
    engine = docker_engines()[0]
    config = one_node(engine)
    async with live_broker(config, db) as live:
        for image in ("a" * 256, "a" * 238, "Upper/Case", "a:", "x@sha256:" + "0" * 32, "localhost/../x"):
            status, body = await live.call("POST", "/v1/environments", json={"task": "t", "image": image})
            assert (status, body["error"]["field"]) == (400, "image"), (image, body)
            status, body = await live.call("POST", "/v1/actions", json=exec_action("true", image=image))
            assert (status, body["error"]["field"]) == (400, "spec.image"), (image, body)
        for image in ("a" * 237, "registry.example:5000/x/y:tag", "x@sha256:" + "0" * 64):
            status, body = await live.call("POST", "/v1/environments", json={"task": "t", "image": image})
            assert (status, body["error"]["code"]) == (422, "image_not_found"), (image, body)
        assert labelled_containers(engine, config["cpu"]["broker_id"]) == []


async def test_files_for_a_trajectory_that_has_its_environment_are_written_before_the_command(db):
    """Files are written when an environment is created, and, sent with a later action, before its command once the
    commands running there have ended (issue 38; they used to be refused). A replay of the action that made the
    environment, under its key, is that action. An action queued before its trajectory's first one made the
    environment writes its files too."""
    async with live_broker(one_node(docker_engines()[0]), db) as live:
        made = {**exec_action("cat a.txt", trajectory="f", files={"a.txt": "1"}), "idempotency_key": "f-1"}
        first = await run(live, made)
        assert first["result"]["stdout"] == "1"
        status, replay = await live.call("POST", "/v1/actions", json=made)  # a retry after a lost answer
        assert (status, replay["id"]) == (200, first["id"]), replay
        later = await run(live, exec_action("cat a.txt", trajectory="f", files={"a.txt": "2"}))
        assert (later["result"]["stdout"], later["result"]["environment"]) == ("2", first["result"]["environment"])
        again = await run(live, exec_action("cat a.txt", trajectory="f"))
        assert again["result"]["stdout"] == "2"
        # two actions of a new trajectory, both with files, submitted before either runs: the first makes it
        made = exec_action("sleep 0.3; cat a.txt", trajectory="g", files={"a.txt": "made"})
        late = exec_action("echo ran > ran.txt; cat a.txt", trajectory="g", files={"a.txt": "late"})
        status, body = await live.call("POST", "/v1/actions:batch", json={"actions": [made, late]})
        assert status == 200, body
        made_id, late_id = (record["id"] for record in body["actions"])
        _, made_record = await live.call("GET", f"/v1/actions/{made_id}?wait=true")
        _, late_record = await live.call("GET", f"/v1/actions/{late_id}?wait=true")
        assert late_record["result"]["stdout"] == "late", late_record
        assert late_record["result"]["environment"] == made_record["result"]["environment"]
        check = await run(live, exec_action("ls; cat a.txt", trajectory="g"))
        assert check["result"]["stdout"] == "a.txt\nran.txt\nlate"


def marked_threads(mark: str) -> dict[int, set[int]]:
    """tid -> affinity of every thread of the processes (seen from the host) whose command line has ``mark``."""
    found = {}
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and mark in Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace"):
                for tid in os.listdir(f"/proc/{name}/task"):
                    found[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # gone meanwhile
            continue
    return found


async def test_fast_path_repins_a_running_command_onto_other_cores():
    """A malleable action's cores change under its running command: the cgroup widens, then the executor moves
    every thread of the command's tree (a cpuset rewrite alone leaves a command on its spawn-time cores)."""
    backend = DockerBackend(docker_engines()[0], run_dir=Path("/run/tangram/test-sandboxes"), cores=(0, 1),
                            fast_path=True)
    await backend.start()
    spec = SandboxSpec(env_id=f"repin-{random.randrange(10**9)}", task="t", trajectory=None, image=DEFAULT_IMAGE,
                       memory_mb=256, pids_limit=64, broker_id=new_broker_id(), ephemeral=True)
    sandbox = await backend.create(spec)
    mark = f"1000.{random.randrange(10**8, 10**9)}"
    threaded = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    try:
        await sandbox.set_cores(frozenset({0}))
        command = asyncio.create_task(sandbox.run(ExecRequest(f"sleep {mark} & python3 -c '{threaded}' {mark}; wait",
                                                              cores=(0,), tag="act-1", timeout_s=60)))
        deadline = time.monotonic() + 15
        while len(marked_threads(mark)) < 4 and time.monotonic() < deadline:  # sh, sleep, python's two threads
            await asyncio.sleep(0.05)
        assert set(map(frozenset, marked_threads(mark).values())) == {frozenset({0})}
        await sandbox.set_cores(frozenset({0, 1}))
        await sandbox.set_action_cores("act-1", frozenset({1}))
        threads = marked_threads(mark)
        assert len(threads) == 4 and set(map(frozenset, threads.values())) == {frozenset({1})}, threads
        assert not command.done()
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await command
    finally:
        await sandbox.destroy()
        await backend.close()
