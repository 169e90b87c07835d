"""The GPU manager's use of the disk tier in scheduling: what prefetch loads, and actions waiting for a node that
holds their host copy (delay scheduling). Instances are do-nothing stand-ins (the real torch worker's loads are in
``test_disk_tier.py``); admission, chunks, residency and the host tier are the manager's own."""

from __future__ import annotations

import pytest

from managers.gpu.config import parse_gpu_config
from managers.gpu.manager import GpuManager
from tangram.core.action import Action
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler
from tests.standin_services import Clock, IdleBackend, reward


def manager_of(clock: Clock, gpus: int = 1) -> GpuManager:
    """Two nodes holding two of four 100 MiB copies each; prepared in order, so both hold c and d."""
    service = {"backend": "torch", "model": "m", "dops": [1], "gpu_memory_mb": 100, "host_memory_mb": 100}
    config = parse_gpu_config({
        "nodes": {name: {"gpus": gpus, "gpu_memory_mb": 100, "host_memory_mb": 200, "device_type": "cpu",
                         "disk_dir": "/nonexistent"} for name in ("n0", "n1")},
        "services": {name: service for name in "abcd"}})
    manager = GpuManager(config, make_backend=lambda *_: IdleBackend(), clock=clock)
    for node in manager.nodes.values():  # as start leaves them, without writing files
        assert node.tier is not None
        for name in "abcd":
            node.tier.plan_load(name)
            node.tier.loaded(name)
    return manager


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


def test_an_action_waiting_for_its_copy_leaves_the_chunk_to_local_actions_for_one_load_then_takes_its_place(
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
        """One pass as the scheduler runs it: ``waiting`` first, then ``behind``."""
        fit = manager.fit()
        placed = fit.try_add(waiting, {"gpu": 1})
        assert placed or not fit.holds_back(waiting)
        return placed, [fit.pool_of(a, "gpu") for a in behind if fit.try_add(a, {"gpu": 1})]

    assert pass_(reward("d", clock.now)) == (False, ["n0"])  # d is held on n0: it takes the chunk
    assert pass_() == (False, [])  # n0 idle, but a has not waited a load's time yet
    assert manager.next_change_in() == pytest.approx(load_s)
    clock.now += load_s / 2
    assert pass_() == (False, []) and manager.next_change_in() == pytest.approx(load_s / 2)
    clock.now += load_s / 2 + 1e-9  # (float steps)
    assert pass_(reward("d", clock.now)) == (True, [])  # waited one load's time: first in the queue, first served
    assert manager.next_change_in() is None


def test_the_scheduler_lets_local_actions_go_first_until_the_deferred_one_has_waited_one_load() -> None:
    """The same, through Alg. 1's step 1: the deferred action holds nobody back, then goes in its queue order
    (however many local actions keep coming, it waits one load's time at most)."""
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
    assert [(p.action.id, p.pools["gpu"]) for p in placed] == [(waiting.id, "n0")]
