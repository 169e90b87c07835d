"""The GPU manager's use of the disk tier in scheduling: what prefetch loads, and actions waiting for a node that
holds their host copy (delay scheduling). Instances are do-nothing stand-ins (the real torch worker's loads are in
``test_disk_tier.py``); admission, chunks, residency and the host tier are the manager's own."""

from __future__ import annotations

from typing import Any

import pytest

from managers.gpu import GpuManager
from managers.gpu_config import parse_gpu_config
from reward_services.backend import ServiceBackend, ServiceInstance, ServiceSpec
from tangram.core.action import Action, Demand, Kind
from tangram.durations import DurationModel
from tangram.scheduler import Scheduler


class _Idle(ServiceInstance):
    async def prepare(self) -> None: ...

    async def restore(self) -> None: ...

    async def evict(self) -> None: ...

    async def infer(self, request: Any) -> dict[str, Any]:
        return {}

    async def close(self) -> None: ...


class _Tiered(ServiceBackend):
    shares_host_copy = True
    tiered = True

    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> ServiceInstance:
        return _Idle(spec, devices)

    async def spill(self, spec: ServiceSpec) -> None: ...

    async def drop_host(self, spec: ServiceSpec) -> None: ...

    async def load_host(self, spec: ServiceSpec) -> None: ...


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager_of(clock: Clock, gpus: int = 1) -> GpuManager:
    """Two nodes holding two of four 100 MiB copies each; prepared in order, so both hold c and d."""
    service = {"backend": "torch", "model": "m", "dops": [1], "gpu_memory_mb": 100, "host_memory_mb": 100}
    config = parse_gpu_config({
        "nodes": {name: {"gpus": gpus, "gpu_memory_mb": 100, "host_memory_mb": 200, "device_type": "cpu",
                         "disk_dir": "/nonexistent"} for name in ("n0", "n1")},
        "services": {name: service for name in "abcd"}})
    manager = GpuManager(config, make_backend=lambda *_: _Tiered(), clock=clock)
    for node in manager.nodes.values():  # as start leaves them, without writing files
        assert node.tier is not None
        for name in "abcd":
            node.tier.plan_load(name)
            node.tier.loaded(name)
    return manager


def reward(service: str, submitted_at: float) -> Action:
    return Action(task="t", kind=Kind.REWARD, demands={"gpu": Demand((1,))}, submitted_at=submitted_at,
                  spec={"service": service, "input": {"pairs": [["x", "y"]]}})


def test_prefetch_loads_each_service_nobody_holds_on_one_node_keeping_what_is_needed_sooner() -> None:
    manager = manager_of(Clock())
    def plan(services: str) -> list[tuple[str, str, list[str]]]:
        return [(node.name, service, [v.service for v in victims])
                for node, service, victims in manager.prefetch_plan([reward(name, 0.0) for name in services])]

    # c is needed first: n0 drops d for a; n1, busy with nothing, drops its d (the last copy now) for b, since
    # c is needed first and a is on its way
    assert plan("ccab") == [("n0", "a", ["d"]), ("n1", "b", ["d"])]
    assert plan("ab") == []  # both on their way
    assert plan("abd") == []  # one load at a time on each node


def test_an_action_waiting_for_its_copy_leaves_the_chunk_to_local_actions_and_takes_an_idle_one_after_a_load(
) -> None:
    clock = Clock()
    manager = manager_of(clock)
    n0, n1 = manager.nodes["n0"], manager.nodes["n1"]
    assert n0.tier is not None and n1.tier is not None
    n1.tier.plan_load("a", keep=["c"])  # now n1 holds a and c; n0 holds c and d
    n1.tier.loaded("a")
    manager.allocate(reward("a", clock.now), {"gpu": 1}, {"gpu": "n1"})  # n1's one GPU is taken
    load_s = manager.disk.load_time.estimate("a")
    waiting = reward("a", clock.now)

    def pass_(*behind: Action) -> tuple[bool, list[str]]:
        """One pass as the scheduler runs it: ``waiting`` first, then ``behind``, then the relaxed round."""
        fit = manager.fit()
        placed = fit.try_add(waiting, {"gpu": 1})
        assert placed or (fit.defers(waiting) and not fit.holds_back(waiting))
        others = [fit.pool_of(a, "gpu") for a in behind if fit.try_add(a, {"gpu": 1})]
        if not placed:
            fit.relax()
            placed = fit.try_add(waiting, {"gpu": 1})
        return placed, others

    assert pass_(reward("d", clock.now)) == (False, ["n0"])  # d is held on n0: it takes the chunk
    assert pass_() == (False, [])  # n0 idle, but a has not waited a load's time yet
    assert manager.next_change_in() == pytest.approx(load_s)
    clock.now += load_s / 2
    assert pass_() == (False, []) and manager.next_change_in() == pytest.approx(load_s / 2)
    clock.now += load_s / 2 + 1e-9  # (float steps)
    assert pass_(reward("d", clock.now)) == (False, ["n0"])  # a local action still goes first
    assert pass_() == (True, [])  # the chunk would idle: a loads its copy on n0


def test_the_scheduler_lets_local_actions_take_the_chunk_first_and_gives_an_idle_one_to_the_deferred() -> None:
    """The same, through Alg. 1's step 1: the deferred action holds nobody back, then takes what nobody took."""
    clock = Clock()
    manager = manager_of(clock)
    n1 = manager.nodes["n1"]
    assert n1.tier is not None
    n1.tier.plan_load("a", keep=["c"])
    n1.tier.loaded("a")
    manager.allocate(reward("a", clock.now), {"gpu": 1}, {"gpu": "n1"})
    scheduler = Scheduler([manager], DurationModel())
    waiting, local = reward("a", clock.now), reward("d", clock.now)
    for action in (waiting, local):
        manager.validate(action)
    placed = scheduler.schedule([waiting, local], [], clock.now).placements
    assert [(p.action.id, p.pools["gpu"]) for p in placed] == [(local.id, "n0")]
    assert scheduler.schedule([waiting], [], clock.now).placements == []  # n0 idle, but no load's time yet
    clock.now += manager.disk.load_time.estimate("a") + 1e-9
    later = reward("d", clock.now)
    manager.validate(later)
    placed = scheduler.schedule([waiting, later], [], clock.now).placements
    assert [(p.action.id, p.pools["gpu"]) for p in placed] == [(later.id, "n0")]  # still, local first
    placed = scheduler.schedule([waiting], [], clock.now).placements
    assert [(p.action.id, p.pools["gpu"]) for p in placed] == [(waiting.id, "n0")]
