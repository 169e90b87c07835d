"""CPU manager logic without Docker: core choice, exec specs, config, node placement; and the local-process backend."""

from __future__ import annotations

import asyncio
import json
import os

import psutil
import pytest

from managers.cpu.config import CpuNodeConfig, on_this_host, parse_cpu_config
from managers.cpu.cores import CorePool
from managers.cpu.exec_spec import ExecLimits, exec_request, parse_exec_spec, rewrite_pytest, runner_report
from managers.cpu.long_tests import (
    LONG_TESTS_ENV,
    LONG_TESTS_LINE,
    MAX_LINE_CHARS,
    TESTS_KEPT,
    LongTests,
    long_tests_from,
)
from managers.cpu.manager import CpuManager
from managers.cpu.node import CpuNode
from sandboxes.cgroup import cpu_list, parse_cpu_list
from tangram.core.action import Action, Demand, Kind
from tangram.core.errors import BadRequest, ConfigError, Unavailable, Unprocessable
from tangram.sim.broker_station import NoSandboxes
from tests.docker_nodes import cpu_config
from tests.harness import live_broker


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    assert cpu_list([5, 0, 2]) == "0,2,5"


def test_cores_stay_inside_one_numa_node_when_they_fit():
    pool = CorePool([[0, 1, 2, 3], [4, 5, 6, 7]])
    first = pool.take(3)
    assert set(first) <= {0, 1, 2, 3}
    # two cores: the fuller node 0 has only one left, so node 1 gives both
    second = pool.take(2)
    assert set(second) <= {4, 5, 6, 7}
    # one core: best fit is node 0's last core, keeping node 1's two free cores together
    assert pool.numa_of(pool.take(1)) == [0]
    # three cores with two free in one node and none elsewhere cannot fit; two can, in one node
    assert pool.numa_of(pool.take(2)) == [1]
    pool.give_back(first)
    pool.give_back(second)
    spread = pool.take(5)  # no node has five free: spread, the emptiest node first
    assert len(set(spread)) == 5 and pool.numa_of(spread) == [0, 1]
    pool.give_back(spread)
    with pytest.raises(RuntimeError):
        pool.give_back(spread)  # a double release is a bug, never silently absorbed


def test_pytest_rewrite_only_touches_plain_invocations():
    assert rewrite_pytest("pytest tests/", ["-n", "4"]) == "pytest -n 4 tests/"
    assert rewrite_pytest("cd repo && python -m pytest -q", ["-n", "2"]) == "cd repo && python -m pytest -n 2 -q"
    assert rewrite_pytest("pytest -n 8 tests/", ["-n", "4"]) == "pytest -n 8 tests/"
    assert rewrite_pytest("pip install pytest-xdist", ["-n", "4"]) == "pip install pytest-xdist"
    assert rewrite_pytest("echo pytest_plugins", ["-n", "4"]) == "echo pytest_plugins"


def test_exec_request_substitutes_parallelism():
    """The runner by default, for more than one worker (its count, and the cores it started on, which its workers
    follow); the executor is asked to make it importable. xdist on request; plain pytest for one worker."""
    spec = parse_exec_spec({"command": "make -j{parallel_num} && pytest", "pytest_parallel": True,
                            "env": {"A": "1"}}, ExecLimits())
    request = exec_request(spec, (2, 3), 10.0, "/workspace", {"TANGRAM_ACTION_ID": "x"})
    assert request.command == ("make -j2 && pytest -p tangram_runner --tangram-workers=2 --tangram-launch-cores=2 "
                               "--tangram-long-tests")
    assert request.pytest_runner is True and request.reap is True
    assert request.cores == (2, 3) and request.cwd == "/workspace" and request.timeout_s == 10.0
    assert request.env == {"A": "1", "TANGRAM_ACTION_ID": "x", "TANGRAM_NUM_CPUS": "2"}
    xdist = exec_request(spec, (2, 3), 10.0, "/workspace", {}, runner="xdist")
    assert xdist.command == "make -j2 && pytest -n 2" and not xdist.pytest_runner
    argv = parse_exec_spec({"command": ["pytest", "-q"], "pytest_parallel": True}, ExecLimits())
    plain = exec_request(argv, (0,), 1.0, "/w", {})
    assert plain.command == ("pytest", "-q") and not plain.pytest_runner  # one core, fixed: plain pytest
    one = parse_exec_spec({"command": "pytest -q", "pytest_parallel": True}, ExecLimits())
    assert exec_request(one, (5,), 1.0, "/w", {}).command == "pytest -q"
    assert exec_request(one, (5,), 1.0, "/w", {}, runner="xdist").command == "pytest -q"
    malleable = exec_request(argv, (0,), 1.0, "/w", {}, workers=4)
    assert malleable.command == ("pytest", "-p", "tangram_runner", "--tangram-workers=4", "--tangram-launch-cores=1",
                                 "--tangram-long-tests", "-q")
    assert malleable.cores == (0,) and malleable.env["TANGRAM_NUM_CPUS"] == "4"
    assert exec_request(one, (0,), 1.0, "/w", {}, workers=1).command == "pytest -q"
    assert exec_request(argv, (0,), 1.0, "/w", {}, workers=4, runner="xdist").command == ("pytest", "-n", "4", "-q")
    no_pytest = parse_exec_spec({"command": "make test", "pytest_parallel": True}, ExecLimits())
    assert not exec_request(no_pytest, (0, 1), 1.0, "/w", {}).pytest_runner


def test_a_run_whose_workers_follow_its_cores_starts_one_per_core_on_one_core_too():
    """Capped at 8 and started on one core, it runs the runner with one worker (so that it can grow), and its
    command sees one; under xdist (an adopted older executor) it starts on its cores and runs plain on one."""
    argv = parse_exec_spec({"command": ["pytest", "-q"], "pytest_parallel": True}, ExecLimits())
    one = exec_request(argv, (3,), 1.0, "/w", {}, workers=8, follows=True)
    assert one.command == ("pytest", "-p", "tangram_runner", "--tangram-workers=1", "--tangram-launch-cores=1",
                           "--tangram-long-tests", "-q") and one.pytest_runner
    assert one.env["TANGRAM_NUM_CPUS"] == "1"
    two = parse_exec_spec({"command": "cd r && python3 -m pytest -x", "pytest_parallel": True}, ExecLimits())
    assert exec_request(two, (0, 1), 1.0, "/w", {}, workers=8, follows=True).command == \
        "cd r && python3 -m pytest -p tangram_runner --tangram-workers=2 --tangram-launch-cores=2 " \
        "--tangram-long-tests -x"
    assert exec_request(two, (0, 1), 1.0, "/w", {}, workers=8, follows=True, runner="xdist").command == \
        "cd r && python3 -m pytest -n 2 -x"
    assert exec_request(argv, (3,), 1.0, "/w", {}, workers=8, follows=True, runner="xdist").command == \
        ("pytest", "-q")


def test_the_runner_gets_its_signatures_long_tests_and_xdist_does_not():
    spec = parse_exec_spec({"command": "pytest -q", "pytest_parallel": True}, ExecLimits())
    long_tests = {"tests/test_slow.py::test_a": 12.5}
    request = exec_request(spec, (0, 1), 1.0, "/w", {}, long_tests=long_tests)
    assert json.loads(request.env[LONG_TESTS_ENV]) == long_tests
    assert LONG_TESTS_ENV not in exec_request(spec, (0, 1), 1.0, "/w", {}).env
    assert LONG_TESTS_ENV not in exec_request(spec, (0, 1), 1.0, "/w", {}, long_tests={}).env
    assert LONG_TESTS_ENV not in exec_request(spec, (0, 1), 1.0, "/w", {}, runner="xdist",
                                              long_tests=long_tests).env
    assert LONG_TESTS_ENV not in exec_request(spec, (0,), 1.0, "/w", {}, long_tests=long_tests).env  # plain


def test_long_tests_are_read_from_the_runners_line_as_untrusted_input():
    given = {"a/test_x.py::test_y[1]": 3.5, "b.py::t": 1, "/etc/passwd": 2.0, "c.py::t": -1, "d.py::t": "9",
             "e.py::t": True, "f\nx.py::t": 1.0, "g.py::t": 1e308 * 10, "h.py::t": 8 * 86400, "": 1.0}
    assert long_tests_from(f"....\n{LONG_TESTS_LINE} {json.dumps(given)}\n4 passed") == {
        "a/test_x.py::test_y[1]": 3.5, "b.py::t": 1.0}
    for malformed in ("4 passed", f"{LONG_TESTS_LINE} [1, 2]", f"{LONG_TESTS_LINE} {{\"cut off",
                      f"{LONG_TESTS_LINE} " + " " * (MAX_LINE_CHARS + 1) + "{}"):
        assert long_tests_from(malformed) == {}
    many = json.dumps({f"t.py::t{i}": float(i) for i in range(TESTS_KEPT + 10)})
    assert len(long_tests_from(f"{LONG_TESTS_LINE} {many}")) == TESTS_KEPT


def test_long_tests_keep_the_longest_per_signature_and_forget_the_least_recent():
    tests = LongTests(signatures_kept=2, tests_kept=3)
    tests.learn(("t", "s1"), {"a::x": 1.0, "b::x": 5.0})
    tests.learn(("t", "s1"), {"a::x": 2.0, "c::x": 4.0, "d::x": 0.5})  # the newest figure per test, the 3 longest
    assert tests.hint(("t", "s1")) == {"b::x": 5.0, "c::x": 4.0, "a::x": 2.0}
    tests.learn(("t", "s2"), {"x::x": 1.0})
    tests.learn(("t", "s2"), {})
    assert tests.hint(("t", "s1"))  # s1 was run more recently than s2 now
    tests.learn(("t", "s3"), {"y::x": 1.0})
    assert tests.hint(("t", "s2")) == {} and tests.hint(("t", "s1")) and tests.hint(("t", "s3"))


def test_the_runners_line_says_which_ran():
    assert runner_report("....\ntangram-runner: 2 worker(s) forked after one collection\n4 passed") == \
        {"runner": "tangram", "detail": "2 worker(s) forked after one collection"}
    assert runner_report("tangram-runner: plain pytest (xdist was asked for too)\n")["runner"] == "plain"
    assert runner_report("4 passed") == {"runner": "unknown", "detail": None}


@pytest.mark.parametrize("spec, field, refusal", [
    ({}, "spec.command", BadRequest),
    ({"command": ""}, "spec.command", BadRequest),
    ({"command": ["ls", 3]}, "spec.command[1]", BadRequest),
    ({"command": "ls", "env": {"1BAD": "x"}}, "spec.env.1BAD", BadRequest),
    ({"command": "ls", "env": {"A\n": "x"}}, "spec.env.A\n", BadRequest),
    ({"command": "ls", "cwd": "relative"}, "spec.cwd", BadRequest),
    ({"command": "ls", "memory_mb": 1}, "spec.memory_mb", BadRequest),
    ({"command": "ls", "output_limit": -1}, "spec.output_limit", BadRequest),
    ({"command": "ls", "files": {"a": {"base64": "!!"}}}, "spec.files.a.base64", BadRequest),
    ({"command": "ls", "files": {"a": {"base64": "QQ"}}}, "spec.files.a.base64", BadRequest),  # unpadded
    ({"command": "ls", "files": {"/etc/passwd": "x"}}, "spec.files./etc/passwd", BadRequest),
    ({"command": "ls", "files": {"": "x"}}, "spec.files.", BadRequest),
    # what the document's schema allows but the broker refuses is unprocessable (422), not malformed (400)
    ({"command": "ls", "files": {"a/../../etc/passwd": "x"}}, "spec.files.a/../../etc/passwd", Unprocessable),
    ({"command": "ls", "environment": "env-1", "image": "x"}, "spec.environment", Unprocessable),
])
def test_bad_exec_specs_name_the_field(spec, field, refusal):
    with pytest.raises(refusal) as caught:
        parse_exec_spec(spec, ExecLimits())
    assert caught.value.field == field


@pytest.mark.parametrize("raw, key", [
    ({"nodes": {"r": {"engine": "tcp://10.0.0.2:2376"}}}, "cpu.nodes.r.cores"),
    ({"nodes": {"r": {"engine": "tcp://10.0.0.2:2376", "cores": "0-3"}}}, "cpu.nodes.r.memory_mb"),
    ({"nodes": {"n": {"engine": "http://x"}}}, "cpu.nodes.n.engine"),
    ({"nodes": {"n": {"cores": "0-1", "numa": ["0"]}}}, "cpu.nodes.n.numa"),
    ({"nodes": {"n": {"backend": "podman"}}}, "cpu.nodes.n.backend"),
    ({"nodes": {"n": {"tls_ca": "/nonexistent"}}}, "cpu.nodes.n.tls_ca"),
    ({"idle_ttl_s": 0}, "cpu.idle_ttl_s"),
    ({"limits": {"max_files": 0}}, "cpu.limits.max_files"),
    ({"join": {"backend": "podman"}}, "cpu.join.backend"),
    ({"join": {"engine": "http://x"}}, "cpu.join.engine"),
    ({"join": {"cores": "0-3"}}, "cpu.join.cores"),  # a joining node's agent reads its cores on its host
    ({"color": "blue"}, "cpu.color"),
    ({"run_dir": "/tmp/" + "d" * 80}, "cpu.run_dir"),
])
def test_bad_cpu_config_names_the_key(raw, key):
    with pytest.raises(ConfigError) as caught:
        parse_cpu_config(raw)
    assert caught.value.key == key


def test_with_join_and_no_nodes_the_broker_waits_for_nodes_to_join():
    config = parse_cpu_config({"join": {}})
    assert config.nodes == ()  # no "local" node: every node joins from the Ray cluster
    manager = CpuManager(config)
    with pytest.raises(Unavailable) as caught:  # a 503 to retry, not a 422: nodes may join any moment
        manager.environments.check_memory(None, "spec.memory_mb")
    assert caught.value.field == "spec.memory_mb" and caught.value.retry_after_s
    with pytest.raises(ConfigError) as refused:
        parse_cpu_config({"nodes": {}})
    assert refused.value.key == "cpu.nodes"


def test_a_node_behind_an_agent_leaves_its_hardware_to_the_agent():
    config = parse_cpu_config({"nodes": {"far": {"agent": True}}, "join": {"engine": "unix:///run/d.sock"}})
    assert config.nodes[0].cores == () and config.nodes[0].memory_mb == 0
    assert on_this_host(config.nodes[0]) == config.nodes[0]  # the broker's host does not say what it has
    assert config.join is not None and config.join.node("n7") == CpuNodeConfig(
        name="n7", engine="unix:///run/d.sock", agent=True)


def _manager_with_nodes(memory: dict[str, int], cores: dict[str, list[int]]) -> CpuManager:
    manager = CpuManager(parse_cpu_config({}))
    for name, memory_mb in memory.items():
        node_config = CpuNodeConfig(name=name, cores=tuple(cores[name]), memory_mb=memory_mb)
        manager.nodes[name] = CpuNode(node_config, NoSandboxes())
    return manager


def _exec(trajectory: str | None, memory_mb: int, cpu: int = 1) -> Action:
    return Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.fixed(cpu)}, trajectory=trajectory,
                  spec={"command": "true", "memory_mb": memory_mb})


def test_first_action_picks_the_node_with_cores_now_and_memory_for_the_trajectory():
    manager = _manager_with_nodes({"a": 1000, "b": 4000}, {"a": [0, 1, 2, 3], "b": [4, 5]})
    fit = manager.fit()
    big = _exec("t1", 2000)
    assert fit.try_add(big, {"cpu": 1}) and fit.pool_of(big, "cpu") == "b"  # only b has the memory
    small = _exec("t2", 500)
    assert fit.try_add(small, {"cpu": 1}) and fit.pool_of(small, "cpu") == "a"  # a: 50% load after, b: 62.5%
    same = _exec("t1", 2000)
    assert fit.try_add(same, {"cpu": 1}) and fit.pool_of(same, "cpu") == "b"  # the trajectory stays on b
    assert not fit.try_add(_exec("t1", 2000), {"cpu": 1})  # b has no core left: it waits, never moves
    wide = _exec("t3", 100, cpu=3)
    assert fit.try_add(wide, {"cpu": 3}) and fit.pool_of(wide, "cpu") == "a"
    fit.remove(wide)
    assert fit.free["a"] == 3


def test_placed_trajectory_stays_on_its_node_across_passes():
    manager = _manager_with_nodes({"a": 1000, "b": 1000}, {"a": [0], "b": [1]})
    first = _exec("t1", 800)
    fit = manager.fit()
    assert fit.try_add(first, {"cpu": 1})
    node = fit.pool_of(first, "cpu")
    allocation = manager.allocate(first, {"cpu": 1}, {"cpu": node})
    assert manager.nodes[node].memory_reserved == 800
    manager.release(allocation)
    manager.release(allocation)  # idempotent
    later = manager.fit()
    second = _exec("t1", 800)
    assert later.try_add(second, {"cpu": 1}) and later.pool_of(second, "cpu") == node
    other = _exec("t2", 800)
    assert later.try_add(other, {"cpu": 1}) and later.pool_of(other, "cpu") != node


def _local(**extra):
    return cpu_config({"here": {"backend": "local", "unsandboxed": True, "cores": sorted(os.sched_getaffinity(0))[:2]}},
                      **extra)


async def test_local_process_backend_pins_times_out_and_cleans_up(tmp_path):
    async with live_broker(_local(), str(tmp_path / "t.db")) as live:
        body = {"task": "t", "trajectory": "tr", "kind": "exec", "demand": {"cpu": 1},
                "spec": {"command": "grep Cpus_allowed_list /proc/self/status; cat hello.txt",
                         "files": {"hello.txt": "hi"}}}
        status, record = await live.call("POST", "/v1/actions?wait=true", json=body)
        assert status == 200 and record["state"] == "succeeded", record
        core = record["allocation"]["placement"]["cpu"]["cores"][0]
        assert record["result"]["stdout"] == f"Cpus_allowed_list:\t{core}\nhi"
        slow = {**body, "spec": {"command": "sleep 1000.25 & sleep 1000.5"}, "timeout_s": 1}
        status, record = await live.call("POST", "/v1/actions?wait=true", json=slow)
        assert record["state"] == "timed_out"
        await asyncio.sleep(0.2)
        assert not [p for p in psutil.process_iter(["cmdline"]) if "1000.25" in " ".join(p.info["cmdline"] or [])]
        leftover = {**body, "spec": {"command": "sleep 1000.75 &"}}
        status, record = await live.call("POST", "/v1/actions?wait=true", json=leftover)
        env_id = record["result"]["environment"]
        assert [p for p in psutil.process_iter(["cmdline"]) if "1000.75" in " ".join(p.info["cmdline"] or [])]
        status, _ = await live.call("DELETE", f"/v1/environments/{env_id}")
        assert status == 200
        await asyncio.sleep(0.2)
        assert not [p for p in psutil.process_iter(["cmdline"]) if "1000.75" in " ".join(p.info["cmdline"] or [])]


async def test_environment_deleted_while_an_action_waits_for_it_fails_that_action(tmp_path):
    config = cpu_config({"here": {"backend": "local", "unsandboxed": True,
                                  "cores": sorted(os.sched_getaffinity(0))[:1]}})
    async with live_broker(config, str(tmp_path / "t.db")) as live:
        status, env = await live.call("POST", "/v1/environments", json={"task": "t"})
        assert status == 201, env
        blocker = {"task": "t", "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "sleep 0.5"}}
        status, _ = await live.call("POST", "/v1/actions", json=blocker)
        waiting = {**blocker, "spec": {"command": "echo never", "environment": env["id"]}}
        status, second = await live.call("POST", "/v1/actions", json=waiting)
        assert second["state"] == "queued"  # the only core is busy
        status, _ = await live.call("DELETE", f"/v1/environments/{env['id']}")
        assert status == 200
        status, record = await live.call("GET", f"/v1/actions/{second['id']}?wait=true")
        assert record["state"] == "failed" and record["error"]["code"] == "environment_destroyed"
        _, resources = await live.call("GET", "/v1/resources")
        cpu = next(r for r in resources["resources"] if r["resource"] == "cpu")
        assert cpu["in_use"] == 0 and cpu["queued"] == 0
