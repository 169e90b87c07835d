"""The GPU manager on nodes of two types: the typed fit sends an action where it is expected to end first (the speed
prior, then measured run times), and the manager's own placement, solved from the demand it measures, confines
services in the next scheduling pass. Instances are do-nothing stand-ins on a virtual clock; chunks, residency,
the demand model, the placement (HiGHS) and the scheduler are the real ones."""

from __future__ import annotations

from typing import Any

from managers.gpu.config import parse_gpu_config
from managers.gpu.manager import GpuManager
from tangram.core.action import Action
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler
from tests.standin_services import Clock, IdleBackend, reward

#: a scores (compute-bound: an H20 runs it at 15% of an H100's speed), g generates (memory-bound: 119%)
SERVICES = {"a": {"backend": "torch", "model": "m", "task": "similarity"},
            "g": {"backend": "sglang", "model": "m", "task": "generate"}}


def manager_of(clock: Clock, **gpu: Any) -> GpuManager:
    """n0: 4 H20 GPUs, n1: 2 H100 GPUs (virtual), both services admitted on both."""
    config = parse_gpu_config({
        **gpu,
        "nodes": {name: {**node, "gpu_memory_mb": 100, "host_memory_mb": 1000, "device_type": "cpu"}
                  for name, node in {"n0": {"gpus": 4, "type": "h20"}, "n1": {"gpus": 2, "type": "h100"}}.items()},
        "services": {name: {**body, "dops": [1], "gpu_memory_mb": 100, "host_memory_mb": 100}
                     for name, body in SERVICES.items()}})
    return GpuManager(config, make_backend=lambda *_: IdleBackend(), clock=clock, solve_inline=True)


def action_of(manager: GpuManager, service: str, at: float) -> Action:
    action = reward(service, at)
    if service == "g":
        action.spec["input"] = {"prompts": ["x"]}
    manager.validate(action)
    return action


def placed(manager: GpuManager, service: str, now: float) -> str:
    """The node the scheduler's pass starts one action of ``service`` on."""
    plan = Scheduler([manager], DurationModel()).schedule([action_of(manager, service, now)], [], now)
    return plan.placements[0].pools["gpu"]


def ran(manager: GpuManager, service: str, node: str, seconds: float, at: float, restore_s: float = 0.0) -> None:
    """Tell the manager's demand of an action of ``service`` that ran ``seconds`` on one GPU of ``node``."""
    action = action_of(manager, service, at)
    action.units = {"gpu": 1}
    action.placement = {"gpu": {"node": node, "gpus": [0], "service": service}}
    action.execution_s, action.restore_s, action.finished_at = seconds + restore_s, restore_s, at + seconds
    manager.demand.ended(action)


def test_the_typed_fit_sends_an_action_to_the_type_it_runs_fastest_on() -> None:
    clock = Clock()
    typed = manager_of(clock, placement={"method": "none"})
    blind = manager_of(clock, placement={"method": "none"}, fit={"typed": False})
    assert placed(blind, "a", clock.now) == "n0"  # blind to types: the node with the most free GPUs
    assert placed(typed, "a", clock.now) == "n1"  # the prior: an H100 runs a scorer 6.7x faster
    assert placed(typed, "g", clock.now) == "n0"  # and an H20 a generator 1.19x faster


def test_measured_run_times_override_the_prior() -> None:
    clock = Clock()
    manager = manager_of(clock, placement={"method": "none"})
    for _ in range(3):  # measured here: a runs faster on the H20s than the datasheets say it could
        ran(manager, "a", "n0", 0.1, clock.now)
        ran(manager, "a", "n1", 1.0, clock.now)
    assert manager.demand.speed("a", "h20") > 1.0
    assert placed(manager, "a", clock.now) == "n0"


def test_a_restore_counts_against_a_node_where_the_service_is_not_resident() -> None:
    clock = Clock()
    manager = manager_of(clock, placement={"method": "none"})
    for _ in range(3):  # a's run takes 1 s on either type
        ran(manager, "a", "n0", 1.0, clock.now)
        ran(manager, "a", "n1", 1.0, clock.now, restore_s=0.0)
    residency = manager.nodes["n0"].residency
    slot = next(s for s in residency.slots.values() if s.service == "a" and s.chunk.gpus == (0,))
    residency.plan_restore(slot)
    residency.restored(slot)
    assert placed(manager, "a", clock.now) == "n0"  # resident there: no restore, the same run time


def test_auto_placement_is_on_for_two_types_and_confines_from_measured_demand() -> None:
    clock = Clock()
    manager = manager_of(clock)
    assert manager.live is not None and manager.live.method == "ilp"
    manager.fit()  # no demand yet: nothing is solved, nothing confined
    assert manager.live.placement is None and manager.allowed == {}
    for i in range(50):  # g is asked for 10x more than a: g needs both types, a has the H100s' left-over
        clock.now += 0.1
        manager.demand.submitted(action_of(manager, "g", clock.now))
        if i % 10 == 0:
            manager.demand.submitted(action_of(manager, "a", clock.now))
    manager.live.stale()
    manager.fit()
    placement = manager.live.placement
    assert placement is not None and placement.method == "ilp"
    assert set(placement.variants("a")) == {"h100"}  # an H20 runs g 8x faster than a: a has none of it
    assert set(placement.variants("g")) == {"h100", "h20"}
    assert manager.allowed["a"] == frozenset({"n1"})
    assert placed(manager, "a", clock.now) == "n1"
    described = {s["name"]: s for s in manager.describe_services()}
    assert described["a"]["placement"]["confined"] is True
    assert described["a"]["placement"]["types"].keys() == {"h100"}
    assert described["g"]["placement"]["load"] > described["a"]["placement"]["load"] > 0


def test_a_service_without_demand_is_left_on_every_node() -> None:
    clock = Clock()
    manager = manager_of(clock)
    for _ in range(20):
        clock.now += 0.1
        manager.demand.submitted(action_of(manager, "a", clock.now))
    manager.fit()
    assert manager.live is not None and manager.live.placement is not None
    assert "a" in manager.allowed and "g" not in manager.allowed
    assert placed(manager, "g", clock.now) == "n0"  # the typed fit, on every node


def test_one_type_needs_no_placement_unless_asked_for() -> None:
    clock = Clock()
    config = parse_gpu_config({"nodes": {"n0": {"gpus": 2, "gpu_memory_mb": 100, "host_memory_mb": 1000,
                                                "device_type": "cpu"}},
                               "services": {"a": {"backend": "torch", "model": "m", "gpu_memory_mb": 100,
                                                  "host_memory_mb": 100}}})
    assert GpuManager(config, make_backend=lambda *_: IdleBackend(), clock=clock).live is None
    asked = parse_gpu_config({"placement": {"method": "greedy"},
                              "nodes": {"n0": {"gpus": 2, "gpu_memory_mb": 100, "host_memory_mb": 1000,
                                               "device_type": "cpu"}},
                              "services": {"a": {"backend": "torch", "model": "m", "gpu_memory_mb": 100,
                                                 "host_memory_mb": 100}}})
    live = GpuManager(asked, make_backend=lambda *_: IdleBackend(), clock=clock).live
    assert live is not None and live.method == "greedy"


def test_an_action_waits_for_a_busy_faster_type_as_long_as_the_slower_one_would_cost_it() -> None:
    """The H100s busy, a scorer waits for one rather than run 6.7x slower on a free H20 at once: up to the run time
    it would lose there (delay scheduling across types), then it takes the H20."""
    clock = Clock()
    manager = manager_of(clock, placement={"method": "none"})
    scheduler = Scheduler([manager], DurationModel())
    first = [action_of(manager, "a", clock.now) for _ in range(3)]
    plan = scheduler.schedule(first, [], clock.now)
    assert [p.pools["gpu"] for p in plan.placements] == ["n1", "n1"]  # the third is deferred, not sent to n0
    for placement in plan.placements:
        manager.allocate(placement.action, placement.units, placement.pools)
    lost = manager.demand.gpu_s("a", "h20") - manager.demand.gpu_s("a", "h100")  # 1/0.15 - 1 s: the prior's
    clock.now += lost * 0.9
    assert scheduler.schedule(first[2:], [], clock.now).placements == []
    clock.now += lost * 0.2
    (late,) = scheduler.schedule(first[2:], [], clock.now).placements
    assert late.pools["gpu"] == "n0"
    blind = manager_of(clock, placement={"method": "none"}, fit={"typed": False})  # without the typed fit, no wait
    plan = Scheduler([blind], DurationModel()).schedule([action_of(blind, "a", clock.now) for _ in range(7)], [],
                                                        clock.now)
    assert len(plan.placements) == 6
