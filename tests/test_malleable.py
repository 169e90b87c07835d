"""Malleable elastic actions: the sharing policy against brute force, exclusive cores under random resizes, and
cores that really move under a running command on the Docker engines (fast path and ``docker update``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any, Literal

import docker
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from managers.cpu.config import CpuConfig, CpuNodeConfig
from managers.cpu.manager import CpuManager
from managers.cpu.node import CpuNode
from managers.cpu.resizing import CpuResizing
from sandboxes.docker import DockerSandbox
from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.malleable import (
    Malleable,
    Profile,
    WorkerCost,
    Workers,
    profile_of_curve,
    share,
    workers_for,
)
from tangram.records import ActionRecord
from tangram.sched import dispatch
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler
from tangram.sim.broker_station import NoSandboxes
from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import Live, live_broker

# ---------------------------------------------------------------------------------------------------------------
# the sharing policy
# ---------------------------------------------------------------------------------------------------------------

amdahl = st.floats(min_value=0.0, max_value=0.5)


def profile(elasticity: Elasticity, counts: tuple[int, ...]) -> Profile:
    """The declared speed-up ``E(k)·k`` over ``counts``."""
    curve = np.array([0.0] + [elasticity.efficiency_at(k) * k for k in range(1, counts[-1] + 1)])
    return profile_of_curve(curve, counts)


def amdahl_profile(serial: float, counts: tuple[int, ...]) -> Elasticity:
    return Elasticity("cpu", tuple((m, 1.0 / (serial * m + 1.0 - serial)) for m in range(1, counts[-1] + 1)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(amdahl, st.integers(1, 3), st.integers(0, 5)), min_size=1, max_size=4),
       st.integers(0, 12))
def test_share_maximises_summed_speedup(jobs: list[tuple[float, int, int]], spare: int) -> None:
    """Against every allocation: none within the spare units gives a larger summed speed-up (concave profiles)."""
    profiles = []
    for serial, floor, extra in jobs:
        counts = tuple(range(floor, floor + extra + 1))
        profiles.append(profile(amdahl_profile(serial, counts), counts))
    units = share(spare, profiles, lambda i: 10.0)
    floors = [p.counts[0] for p in profiles]
    assert sum(units) - sum(floors) <= spare
    assert all(p.counts[0] <= u <= p.counts[-1] for p, u in zip(profiles, units))

    def total(allocation: tuple[int, ...]) -> float:
        return sum(p.speedup(u) for p, u in zip(profiles, allocation))

    best = max(total(a) for a in itertools.product(*(p.counts for p in profiles))
               if sum(a) - sum(floors) <= spare)
    assert total(tuple(units)) == pytest.approx(best, rel=1e-9)


def test_share_gives_no_unit_that_speeds_nobody_up() -> None:
    flat_after_two = Elasticity("cpu", ((1, 1.0), (2, 1.0), (3, 2 / 3), (4, 0.5)))  # s(2) = s(3) = s(4) = 2
    counts = (1, 2, 3, 4)
    assert share(10, [profile(flat_after_two, counts)], lambda i: 5.0) == [2]


def test_share_by_remaining_prefers_shorter_work() -> None:
    counts = tuple(range(1, 9))
    curve = profile(amdahl_profile(0.1, counts), counts)
    remaining = [1.0, 100.0].__getitem__
    by_speedup = share(6, [curve, curve], remaining)
    by_remaining = share(6, [curve, curve], remaining, by_remaining=True)
    assert by_speedup == [4, 4]  # the same curve: an even split
    assert by_remaining[0] > by_remaining[1] and sum(by_remaining) == 8


@pytest.mark.parametrize("running_left, starting_work, started", [(90.0, 2.7, True), (2.0, 50.0, False)])
def test_an_equal_gain_goes_to_the_least_remaining_work(running_left: float, starting_work: float,
                                                          started: bool) -> None:
    """A linear speed-up gives a running run's second core the gain of a starting run's first: the throughput is
    the same either way, so the shorter of the two takes the core (a short suite does not queue behind a long one
    that holds every core, and a long one does not slow a short one near its end)."""
    linear = Elasticity("cpu", ((1, 1.0), (2, 1.0)))
    running = (profile(linear, (1, 2)), running_left)
    starting = (profile(linear, (0, 1, 2)), starting_work)
    for order in ([running, starting], [starting, running]):  # whichever comes first
        units = share(1, [p for p, _ in order], [work for _, work in order].__getitem__)
        assert units[order.index(running)] == (1 if started else 2)
        assert units[order.index(starting)] == (1 if started else 0)


def test_workers_bound_start_up_to_a_share_of_the_run() -> None:
    # 20 s expected on one core, 0.25 s per worker, 5%: 1 s of start-up buys 4 more workers
    quarter = WorkerCost(0.25)
    assert workers_for(1, 32, 20.0, quarter, 0.05) == 5
    assert workers_for(8, 32, 200.0, quarter, 0.05) == 32  # long runs get every worker they can use
    assert workers_for(3, 32, 0.5, quarter, 0.05) == 3  # never fewer workers than cores
    assert workers_for(2, 32, 20.0, WorkerCost(0.0), 0.05) == 32  # free workers: as many as it could ever use
    assert workers_for(2, 32, 20.0, quarter, 0.0) == workers_for(2, 32, 20.0, WorkerCost(0.0), 0.0) == 2  # no share
    # going parallel at all costs 0.8 s (a controller): from one core, only what is left of the 1 s buys workers
    assert workers_for(1, 32, 20.0, WorkerCost(0.25, harness_s=0.8), 0.05) == 1
    assert workers_for(1, 32, 40.0, WorkerCost(0.25, harness_s=0.8), 0.05) == 5
    assert workers_for(2, 32, 20.0, WorkerCost(0.25, harness_s=0.8), 0.05) == 6  # already parallel: no harness


def test_progress_is_work_done_at_the_estimated_speed() -> None:
    counts = (1, 2, 3, 4)
    curve = profile(Elasticity("cpu", ((1, 1.0), (4, 1.0))), counts)
    held = Malleable("cpu", "n", floor=1, workers=4, units=4, since=0.0, t1_s=40.0, profile=curve,
                     history=[(0.0, 4)])
    assert held.remaining_s(5.0) == pytest.approx(20.0)  # 5 s on 4 cores
    held.resize(2, 5.0)
    assert held.remaining_s(10.0) == pytest.approx(10.0)  # then 5 s on 2
    assert held.unit_seconds_at(10.0) == pytest.approx(30.0)
    assert held.remaining_s(100.0) == pytest.approx(4.0)  # late: a tenth of its estimate assumed left
    assert held.summary(10.0)["resizes"] == 1 and held.summary(10.0)["history"] == [[0.0, 4], [5.0, 2]]


# ---------------------------------------------------------------------------------------------------------------
# exclusive cores under random resizes
# ---------------------------------------------------------------------------------------------------------------


def resizing(cpu: CpuManager) -> CpuResizing:
    resizing = cpu.resizing("cpu")
    assert resizing is not None
    return resizing


def manager(cores: int = 8) -> CpuManager:
    config = CpuNodeConfig(name="n", cores=tuple(range(cores)), numa=(tuple(range(cores // 2)),
                                                                        tuple(range(cores // 2, cores))),
                           memory_mb=1 << 20)
    cpu = CpuManager(CpuConfig(nodes=(config,)))
    cpu.add_node(CpuNode(config, NoSandboxes()))
    return cpu


def elastic(i: int) -> Action:
    return Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.range(1, 8)}, trajectory=f"traj-{i}",
                  elasticity=Elasticity("cpu", ((1, 1.0), (8, 0.8)), t1=10.0), spec={"command": "true"},
                  id=f"a{i}")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "resize", "end"]), st.integers(0, 7), st.integers(1, 8)),
                max_size=60))
def test_cores_stay_exclusive_under_random_resizes(steps: list[tuple[str, int, int]]) -> None:
    """Starts, resizes and ends in any order (an end racing a resize included): no core is ever held twice, free
    and held cores always make up the node, and a released allocation cannot be resized back into use."""
    cpu = manager()
    node = cpu.nodes["n"]
    held: dict[int, Any] = {}
    for op, who, units in steps:
        if op == "start" and who not in held and units <= len(node.cores.free):
            held[who] = cpu.allocate(elastic(who), {"cpu": units}, {"cpu": "n"})
        elif op == "resize" and who in held:
            allocation = held[who]
            now = len(allocation.handle[2])
            if units <= now + len(node.cores.free):
                resizing(cpu).resize(allocation, units)
                assert len(allocation.handle[2]) == units == allocation.units["cpu"]
                assert allocation.placement["cpu"]["cores"] == list(allocation.handle[2])
        elif op == "end" and who in held:
            allocation = held.pop(who)
            cpu.release(allocation)
            cpu.release(allocation)  # idempotent
            asyncio.run(resizing(cpu).apply(allocation))  # a resize applied after the end: nothing happens
            with pytest.raises(RuntimeError, match="released"):
                resizing(cpu).resize(allocation, units)
        taken = [c for a in held.values() for c in a.handle[2]]
        assert len(taken) == len(set(taken)), "a core is held by two actions"
        assert set(taken).isdisjoint(node.cores.free)
        assert set(taken) | node.cores.free == set(range(8))


def test_shrink_keeps_the_numa_node_holding_most_of_the_cores() -> None:
    cpu = manager()
    allocation = cpu.allocate(elastic(0), {"cpu": 6}, {"cpu": "n"})  # 4 on one NUMA node, 2 on the other
    resizing(cpu).resize(allocation, 4)
    assert allocation.placement["cpu"]["numa_nodes"] == [0] or allocation.placement["cpu"]["numa_nodes"] == [1]
    resizing(cpu).resize(allocation, 5)  # its own NUMA node is full: the fifth core comes from the other
    assert len(allocation.placement["cpu"]["numa_nodes"]) == 2


# ---------------------------------------------------------------------------------------------------------------
# real engines: cores move under a running command
# ---------------------------------------------------------------------------------------------------------------

#: prints its CPU affinity each time it changes, for about ``seconds``
WATCH = ("python3 -c \"import os, time\nlast = None\nend = time.time() + {seconds}\nwhile time.time() < end:\n"
         "    now = sorted(os.sched_getaffinity(0))\n    if now != last:\n        print(now, flush=True)\n"
         "        last = now\n    time.sleep(0.01)\n\"")
ELASTIC = {"resource": "cpu", "t1": 4.0, "efficiency": {"1": 1.0, "2": 0.95}}


def node(engine: str, **extra: Any) -> dict[str, Any]:
    return cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 4096, **extra}})


async def submit(live: Live, body: dict[str, Any]) -> str:
    status, record = await live.call("POST", "/v1/actions", json=body)
    assert status in (200, 201, 202), record
    return record["id"]


async def wait_state(live: Live, action_id: str, states: set[str], timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, record = await live.call("GET", f"/v1/actions/{action_id}")
        assert status == 200, record
        if record["state"] in states or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.05)


def cpu_manager(live: Live) -> CpuManager:
    """The live broker's exec manager: a CPU manager in these tests."""
    manager = live.broker.executor[Kind.EXEC]
    assert isinstance(manager, CpuManager)
    return manager


async def wait_output(live: Live, action_id: str, text: str, timeout_s: float = 30.0) -> None:
    """Until the running command has started (its sandbox made): its environment runs an action."""
    deadline = time.monotonic() + timeout_s
    env = None
    while time.monotonic() < deadline:
        manager = cpu_manager(live)
        env = next((e for e in manager.environments.values() if action_id in e.running), None)
        if env is not None:
            await asyncio.sleep(0.3)  # the command prints its first affinity
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{action_id} never started its command ({text})")


def test_workers_stay_within_the_actions_maximum() -> None:
    action = elastic(0)  # 1-8 cores
    assert resizing(manager()).workers(action, 2, expected_s=10.0) == Workers(2)  # one worker per starting core
    cpu = CpuManager(CpuConfig(nodes=manager().config.nodes, worker_overhead=0.5, worker_start_s=0.25))
    cpu.add_node(CpuNode(cpu.config.nodes[0], NoSandboxes()))
    assert resizing(cpu).workers(action, 2, expected_s=0.25) == Workers(3)  # 50% of 0.25 s on 2 cores pays one worker
    assert resizing(cpu).workers(action, 2, expected_s=100.0) == Workers(8)  # a long run: its maximum, not the node's


@pytest.mark.parametrize("command", ["cd repo && python3 -m pytest -q", ["pytest", "-q"]])
def test_a_pytest_run_the_runner_takes_may_grow_to_its_maximum(command: str | list[str]) -> None:
    """Under the elastic runner a pytest run's workers follow its cores: it may grow from the core it starts on to
    its maximum (within the node), with none started ahead. Under xdist, or for a command the runner does not take
    (no pytest in it, or pytest_parallel off), the workers are fixed at the start as before."""
    def run(spec: dict[str, Any], cores: int = 1) -> Action:
        return Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.range(1, cores)}, trajectory="t",
                      elasticity=Elasticity("cpu", t1=10.0), spec=spec, id="a")

    test_run = {"command": command, "pytest_parallel": True}
    assert resizing(manager()).workers(run(test_run, 4), 1, expected_s=10.0) == Workers(4, follows=True)
    assert resizing(manager(2)).workers(run(test_run, 4), 1, expected_s=10.0) == Workers(2, follows=True)
    assert resizing(manager()).workers(run({"command": command}, 4), 1, expected_s=10.0) == Workers(1)
    assert resizing(manager()).workers(run({"command": "make test", "pytest_parallel": True}, 4), 1,
                             expected_s=10.0) == Workers(1)
    xdist = CpuManager(CpuConfig(nodes=manager().config.nodes, pytest_runner="xdist"))
    xdist.add_node(CpuNode(xdist.config.nodes[0], NoSandboxes()))
    assert resizing(xdist).workers(run(test_run, 4), 1, expected_s=10.0) == Workers(1)


def scheduler_on(runner: Literal["tangram", "xdist"]) -> tuple[Scheduler, CpuManager, dict[str, tuple[Action, Any]]]:
    """A scheduler over an 8-core node whose elastic pytest runs go to ``runner``, and no action running."""
    cpu = CpuManager(CpuConfig(nodes=manager().config.nodes, pytest_runner=runner))
    cpu.add_node(CpuNode(cpu.config.nodes[0], NoSandboxes()))
    return Scheduler([cpu], DurationModel()), cpu, {}


def pass_once(scheduler: Scheduler, cpu: CpuManager, queue: list[Action],
              running: dict[str, tuple[Action, Any]], now: float) -> None:
    """One scheduling pass applied as the broker applies it: shrinks, starts, grows."""
    plan = scheduler.schedule(queue, (a for a, _ in running.values()), now)
    owner: dict[str, Any] = {"cpu": cpu}
    for decision in plan.shrinks():
        dispatch.resize(owner, running[decision.action.id][1], decision, now)
    for placement in plan.placements:
        running[placement.action.id] = (placement.action, dispatch.start(owner, scheduler.durations, placement, now))
        queue.remove(placement.action)
    for decision in plan.grows():
        dispatch.resize(owner, running[decision.action.id][1], decision, now)


def test_a_first_run_takes_only_the_cores_no_estimated_action_gains_from() -> None:
    """A pytest run of a signature nothing is known of yet (no profile declared, none learned) starts on its floor
    as before, and on the runner it also takes the idle cores; a tool call and a run with a declared profile take
    them back at the next pass, and a core that frees goes to the estimated run, not to it. Under xdist it keeps
    one core, fixed (a worker started for a core it may lose costs a re-collection)."""
    def test_run(name: str, elasticity: Elasticity) -> Action:
        return Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.range(1, 8)}, trajectory=name, id=name,
                      elasticity=elasticity, spec={"command": "python3 -m pytest -q", "pytest_parallel": True})

    scheduler, cpu, running = scheduler_on("tangram")
    first = test_run("first", Elasticity("cpu"))
    queue = [first]
    pass_once(scheduler, cpu, queue, running, 0.0)
    assert first.units["cpu"] == 8 and first.malleable is not None and first.malleable.assumed
    known = test_run("known", Elasticity("cpu", amdahl_profile(0.1, tuple(range(1, 9))).efficiency, t1=10.0))
    tool = Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.fixed(1)}, trajectory="tool", id="tool",
                  spec={"command": "true"})
    queue += [tool, known]
    pass_once(scheduler, cpu, queue, running, 1.0)
    assert (first.units["cpu"], tool.units["cpu"], known.units["cpu"]) == (1, 1, 6)
    assert known.malleable is not None and not known.malleable.assumed
    dispatch.release(running.pop("tool")[1])
    pass_once(scheduler, cpu, queue, running, 2.0)
    assert (first.units["cpu"], known.units["cpu"]) == (1, 7)
    dispatch.release(running.pop("known")[1])
    pass_once(scheduler, cpu, queue, running, 3.0)
    assert first.units["cpu"] == 8  # idle again: the first run takes the cores back

    scheduler, cpu, running = scheduler_on("xdist")
    first = test_run("first", Elasticity("cpu"))
    pass_once(scheduler, cpu, [first], running, 0.0)
    assert first.units["cpu"] == 1 and first.malleable is None


@pytest.mark.parametrize("path", ["fast", "engine"])
async def test_a_tool_call_takes_a_core_from_a_running_test_run_and_gives_it_back(tmp_path, path: str) -> None:
    engines = docker_engines()
    engine = engines[0] if path == "fast" else engines[1]
    raw = node(engine, fast_path=path == "fast")
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        await a_tool_call_takes_a_core_and_gives_it_back(live)


async def a_tool_call_takes_a_core_and_gives_it_back(live: Live) -> None:
    """On a live broker whose only node, n1, has two cores: a malleable test run starts on both, shrinks to one
    while a tool call runs, grows back, and its command sees each change."""
    long_run = await submit(live, {"task": "t", "trajectory": "tests", "kind": "exec",
                                   "demand": {"cpu": {"min": 1, "max": 2}}, "elasticity": ELASTIC,
                                   "spec": {"command": WATCH.format(seconds=4), "memory_mb": 128}})
    await wait_output(live, long_run, "first affinity")
    _, running = await live.call("GET", f"/v1/actions/{long_run}")
    assert running["state"] == "running" and running["allocation"]["units"]["cpu"] == 2  # an idle node: both
    _, tool = await live.call("POST", "/v1/actions?wait=true", json={
        "task": "t", "trajectory": "tools", "kind": "exec", "demand": {"cpu": 1},
        "spec": {"command": "sleep 1; grep Cpus_allowed_list /proc/self/status", "memory_mb": 128}})
    assert tool["state"] == "succeeded", tool
    tool_core = tool["allocation"]["placement"]["cpu"]["cores"]
    assert len(tool_core) == 1
    done = await wait_state(live, long_run, {"succeeded", "failed"})
    assert done["state"] == "succeeded", done
    assert tool["started_at"] < done["finished_at"]  # it did not wait for the test run holding both cores
    ActionRecord.model_validate_json(json.dumps(done))  # the record the document describes, resizes and all
    malleable = done["allocation"]["malleable"]
    assert malleable["resizes"] >= 2 and malleable["workers"] == 2  # shrunk for the tool call, grown back
    units = [u for _, u in malleable["history"]]
    assert units[:3] == [2, 1, 2]
    assert 0 < malleable["unit_seconds"] < 2 * (done["finished_at"] - done["started_at"]) + 0.1
    seen = [line for line in done["result"]["stdout"].splitlines() if line.startswith("[")]
    assert seen[0] == "[0, 1]" and seen[-1] == "[0, 1]"
    other = [c for c in (0, 1) if c not in tool_core]
    assert str(other) in seen[1:-1], seen  # while the tool call ran, the test run was on the other core only
    manager = cpu_manager(live)
    assert manager.nodes["n1"].cores.free == {0, 1}
    assert live.broker.metrics.resizes._value.get() >= 2


async def test_a_resize_of_a_dead_sandbox_fails_the_action_and_leaks_no_core(tmp_path) -> None:
    engine = docker_engines()[1]  # docker update path: the engine refuses to update a dead container
    async with live_broker(node(engine, fast_path=False), str(tmp_path / "t.db")) as live:
        long_run = await submit(live, {"task": "t", "trajectory": "tests", "kind": "exec",
                                       "demand": {"cpu": {"min": 1, "max": 2}}, "elasticity": ELASTIC,
                                       "spec": {"command": "sleep 20", "memory_mb": 128}})
        await wait_output(live, long_run, "sleep")
        manager = cpu_manager(live)
        env = next(e for e in manager.environments.values() if long_run in e.running)
        assert isinstance(env.sandbox, DockerSandbox)  # a Docker engine made it
        docker.DockerClient(base_url=engine).containers.get(env.sandbox.container.id).kill()
        _, tool = await live.call("POST", "/v1/actions?wait=true", json={
            "task": "t", "trajectory": "tools", "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": "true", "memory_mb": 128}})
        assert tool["state"] == "succeeded", tool
        done = await wait_state(live, long_run, {"succeeded", "failed", "cancelled", "timed_out"})
        assert done["state"] == "failed" and done["error"]["code"] in ("resize_failed", "environment_lost"), done
        assert "resize" in done["error"]["message"] or "died" in done["error"]["message"]
        for _ in range(50):
            if manager.nodes["n1"].cores.free == {0, 1}:
                break
            await asyncio.sleep(0.05)
        assert manager.nodes["n1"].cores.free == {0, 1}
