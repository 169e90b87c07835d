"""``[gpu.fit] wait_for_resident``: an action whose service is resident on busy GPUs lets the actions behind it take
a free chunk, for up to one restore's time, then takes its place in the queue (delay scheduling,
``managers/gpu/delay_wait.py``). Instances are do-nothing stand-ins on a virtual clock; chunks, residency and the
scheduler are the real ones."""

from __future__ import annotations

import pytest

from managers.gpu.config import parse_gpu_config
from managers.gpu.manager import GpuManager
from tangram.core.action import Action, Demand
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler
from tests.standin_services import Clock, IdleBackend, reward


def two_nodes(clock: Clock, wait_for_resident: bool) -> GpuManager:
    """Nodes n0 and n1 of one GPU each, room for one service per GPU: a is resident on n1 and busy there, b is
    resident on n0, which is free."""
    service = {"backend": "torch", "model": "m", "dops": [1], "gpu_memory_mb": 100, "host_memory_mb": 100}
    config = parse_gpu_config({
        "fit": {"wait_for_resident": wait_for_resident},
        "nodes": {name: {"gpus": 1, "gpu_memory_mb": 100, "host_memory_mb": 300, "device_type": "cpu"}
                  for name in ("n0", "n1")},
        "services": {name: service for name in "abc"}})
    manager = GpuManager(config, make_backend=lambda *_: IdleBackend(), clock=clock)
    for node, name in (("n0", "b"), ("n1", "a")):
        residency = manager.nodes[node].residency
        slot = next(slot for slot in residency.slots.values() if slot.service == name)
        residency.plan_restore(slot)
        residency.restored(slot)
    busy = reward("a", clock.now)
    manager.validate(busy)
    manager.allocate(busy, {"gpu": 1}, {"gpu": "n1"})
    return manager


def queued(manager: GpuManager, *services: str, at: float) -> list[Action]:
    actions = [reward(name, at) for name in services]
    for action in actions:
        manager.validate(action)
    return actions


def placed(scheduler: Scheduler, queue: list[Action], now: float) -> list[tuple[str, str]]:
    plan = scheduler.schedule(queue, [], now)
    return [(p.action.spec["service"], p.pools["gpu"]) for p in plan.placements]


def test_without_it_the_first_action_restores_its_service_on_the_free_gpu() -> None:
    clock = Clock()
    manager = two_nodes(clock, wait_for_resident=False)
    scheduler = Scheduler([manager], DurationModel())
    assert placed(scheduler, queued(manager, "a", "b", at=clock.now), clock.now) == [("a", "n0")]


def test_an_action_waits_one_restore_for_its_busy_instance_while_the_resident_service_goes_first() -> None:
    clock = Clock()
    manager = two_nodes(clock, wait_for_resident=True)
    scheduler = Scheduler([manager], DurationModel())
    restore_s = manager.restore_time.estimate("a")
    waiting, local = queued(manager, "a", "b", at=clock.now)
    assert placed(scheduler, [waiting, local], clock.now) == [("b", "n0")]  # b resident there: no restore
    assert placed(scheduler, [waiting], clock.now) == []  # n0 idle, but a has not waited a restore's time yet
    assert manager.next_change_in() == pytest.approx(restore_s)
    clock.now += restore_s / 2
    assert placed(scheduler, [waiting, *queued(manager, "b", at=clock.now)], clock.now) == [("b", "n0")]
    clock.now += restore_s / 2 + 1e-9
    assert placed(scheduler, [waiting, *queued(manager, "b", at=clock.now)], clock.now) == [("a", "n0")]


def test_a_service_resident_nowhere_does_not_wait() -> None:
    clock = Clock()
    manager = two_nodes(clock, wait_for_resident=True)
    scheduler = Scheduler([manager], DurationModel())
    assert placed(scheduler, queued(manager, "c", "b", at=clock.now), clock.now) == [("c", "n0")]
    assert manager.next_change_in() is None


def test_a_stream_of_local_actions_delays_a_waiting_one_by_one_restore_at_most() -> None:
    """Adversarial arrivals: every pass a new action of the service resident on the free GPU comes behind the
    waiting one and each leaves before the next pass. The waiting action starts once it has waited one restore's
    time since it was first deferred (the bound: its restore estimate, plus the pass that places it)."""
    clock = Clock()
    manager = two_nodes(clock, wait_for_resident=True)
    scheduler = Scheduler([manager], DurationModel())
    restore_s = manager.restore_time.estimate("a")
    waiting = queued(manager, "a", at=clock.now)[0]
    first_deferred = clock.now
    step = restore_s / 7
    while True:
        result = placed(scheduler, [waiting, *queued(manager, "b", at=clock.now)], clock.now)
        if result == [("a", "n0")]:
            break
        assert result == [("b", "n0")] and clock.now - first_deferred < restore_s
        clock.now += step
    assert clock.now - first_deferred <= restore_s + step


def test_the_fit_prefers_the_node_where_the_service_is_resident_at_any_dop_the_action_accepts() -> None:
    """Placed at its minimum (one GPU), an action accepting one or two goes where its service is resident on two:
    the DP may then give it that chunk, and no restore is needed."""
    clock = Clock()
    service = {"backend": "torch", "model": "m", "dops": [1, 2], "gpu_memory_mb": 100, "host_memory_mb": 100}
    config = parse_gpu_config({
        "nodes": {name: {"gpus": 2, "gpu_memory_mb": 100, "host_memory_mb": 300, "device_type": "cpu"}
                  for name in ("n0", "n1")},
        "services": {"a": service}})
    manager = GpuManager(config, make_backend=lambda *_: IdleBackend(), clock=clock)
    residency = manager.nodes["n1"].residency
    pair = next(slot for slot in residency.slots.values() if slot.chunk.size == 2)
    residency.plan_restore(pair)
    residency.restored(pair)
    action = reward("a", clock.now)
    action.demands["gpu"] = Demand((1, 2))
    manager.validate(action)
    fit = manager.fit()
    assert fit.try_add(action, {"gpu": 1}) and fit.pool_of(action, "gpu") == "n1"
