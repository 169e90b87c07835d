"""``GpuManager.place_services``: a placement confines each service's reward actions to the nodes it gives it, and
can never leave a service unservable. Instances are do-nothing stand-ins on a virtual clock; chunks, residency, the
host tier and the scheduler are the real ones."""

from __future__ import annotations

from typing import Any

from managers.gpu.config import parse_gpu_config
from managers.gpu.manager import GpuManager
from tangram.core.action import Action, Demand
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler
from tests.standin_services import Clock, IdleBackend, reward


def manager_of(clock: Clock, gpus: int = 1, services: str = "ab", dops: tuple[int, ...] = (1,),
               **node: Any) -> GpuManager:
    """Nodes n0 and n1 of ``gpus`` GPUs each, every service admitted on both, nothing resident."""
    service = {"backend": "torch", "model": "m", "dops": list(dops), "gpu_memory_mb": 100, "host_memory_mb": 100}
    config = parse_gpu_config({
        "nodes": {name: {"gpus": gpus, "gpu_memory_mb": 100, "host_memory_mb": 1000, "device_type": "cpu", **node}
                  for name in ("n0", "n1")},
        "services": {name: service for name in services}})
    return GpuManager(config, make_backend=lambda *_: IdleBackend(), clock=clock)


def queued(manager: GpuManager, *services: str, at: float) -> list[Action]:
    actions = [reward(name, at) for name in services]
    for action in actions:
        manager.validate(action)
    return actions


def placed(manager: GpuManager, *services: str, now: float = 0.0) -> list[tuple[str, str]]:
    plan = Scheduler([manager], DurationModel()).schedule(queued(manager, *services, at=now), [], now)
    return [(p.action.spec["service"], p.pools["gpu"]) for p in plan.placements]


def make_resident(manager: GpuManager, node: str, service: str, gpu: int = 0) -> None:
    """``service`` resident on ``node``'s GPU ``gpu`` alone."""
    residency = manager.nodes[node].residency
    slot = next(slot for slot in residency.slots.values() if slot.service == service and slot.chunk.gpus == (gpu,))
    residency.plan_restore(slot)
    residency.restored(slot)


def test_an_allowed_set_confines_a_service_to_its_nodes_and_none_restores_every_node() -> None:
    manager = manager_of(Clock())
    assert placed(manager, "a") == [("a", "n0")]  # today: the first of two equal nodes
    manager.place_services({"a": ["n1"]})
    assert placed(manager, "a") == [("a", "n1")]
    assert placed(manager, "b") == [("b", "n0")]  # a service the placement does not name runs anywhere
    manager.place_services(None)
    assert placed(manager, "a") == [("a", "n0")]


def test_a_resident_instance_outside_the_allowed_nodes_does_not_draw_its_actions() -> None:
    manager = manager_of(Clock())
    make_resident(manager, "n0", "a")
    assert placed(manager, "a") == [("a", "n0")]
    manager.place_services({"a": ["n1"]})
    assert placed(manager, "a") == [("a", "n1")]
    assert manager.setup_costs(queued(manager, "a", at=0.0))  # n0's instance saves it no restore


def test_a_service_with_no_usable_allowed_node_is_served_everywhere() -> None:
    manager = manager_of(Clock())
    no_node: tuple[dict[str, list[str]], ...] = ({"a": []}, {"a": ["elsewhere"]})  # empty, or no node of this one
    for allowed in no_node:
        manager.place_services(allowed)
        assert placed(manager, "a") == [("a", "n0")]
    manager.place_services({"a": ["n1"]})
    manager.nodes["n1"].lose("test")
    assert placed(manager, "a") == [("a", "n0")]


def test_an_action_waiting_for_its_full_nodes_lets_actions_placed_elsewhere_go() -> None:
    """FCFS holds per node under a placement: a waits for n1 without keeping b off n0, and nothing behind a takes
    n1 before it."""
    clock = Clock()
    manager = manager_of(clock)
    manager.allocate(reward("a", clock.now), {"gpu": 1}, {"gpu": "n1"})
    assert placed(manager, "a", "b") == [("a", "n0")]  # today: a takes the free node
    manager.place_services({"a": ["n1"]})
    assert placed(manager, "a", "b") == [("b", "n0")]
    manager.place_services({"a": ["n0"], "b": ["n0"]})  # both on the free node: a first, b behind it
    assert placed(manager, "a", "b") == [("a", "n0")]


def test_nodes_an_earlier_action_waits_for_are_kept_from_later_actions() -> None:
    """a needs both of n1's GPUs, one is busy: b, resident on n1's free GPU, goes to n0 instead of overtaking a."""
    clock = Clock()
    manager = manager_of(clock, gpus=2, dops=(1, 2))
    make_resident(manager, "n1", "b", gpu=1)
    manager.allocate(reward("a", clock.now), {"gpu": 1}, {"gpu": "n1"})  # GPU 0
    wide = queued(manager, "a", at=clock.now)[0]
    wide.demands["gpu"] = Demand((2,))
    later = queued(manager, "b", at=clock.now)
    scheduler = Scheduler([manager], DurationModel())
    assert [p.pools["gpu"] for p in scheduler.schedule(later, [], clock.now).placements] == ["n1"]  # resident
    manager.place_services({"a": ["n1"]})
    plan = scheduler.schedule([wide, *later], [], clock.now)
    assert [(p.action.spec["service"], p.pools["gpu"]) for p in plan.placements] == [("b", "n0")]


def tiered(placement: dict[str, list[str]] | None) -> GpuManager:
    """Two nodes holding the copies of b and c (as start leaves them), a's on disk, under ``placement``."""
    manager = manager_of(Clock(), services="abc", host_memory_mb=200, disk_dir="/nonexistent")
    for node in manager.nodes.values():
        assert node.tier is not None
        for name in "abc":
            node.tier.plan_load(name)
            node.tier.loaded(name)
    manager.place_services(placement)
    return manager


def test_prefetch_loads_a_copy_only_on_a_node_its_service_may_run_on() -> None:
    def loads(manager: GpuManager, service: str) -> list[tuple[str, str]]:
        return [(node.name, name) for node, name, _ in manager.prefetch_plan(queued(manager, service, at=0.0))]

    assert loads(tiered(None), "a") == [("n0", "a")]
    assert loads(tiered({"a": ["n1"]}), "a") == [("n1", "a")]
    assert loads(tiered({"b": ["n1"]}), "b") == []  # held on n1 already
