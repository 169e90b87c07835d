"""The contract every manager keeps with the scheduler (``tangram/core/seam.py``), checked on each of them with the
same random workloads: a refused ``try_add`` leaves no trace on the fit, ``release`` is idempotent and gives
everything back, and every plan the scheduler makes (DPArrange over the manager's own operator) is allocatable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from managers.basic.manager import BasicManager, BasicResourceConfig
from managers.counted import CountedUnitsManager
from managers.cpu.config import CpuConfig, CpuNodeConfig
from managers.cpu.manager import CpuManager
from managers.cpu.node import CpuNode
from managers.gpu.config import parse_gpu_config
from managers.gpu.manager import GpuManager
from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.seam import ResourceManager
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler, allocate_placement
from tangram.sim.broker_station import NoSandboxes

EFFICIENCY = ((1, 1.0), (2, 0.9), (4, 0.8))


@dataclass(frozen=True)
class Subject:
    """A manager under test: how to build it, the resource its actions demand and how to make one."""

    build: Callable[[], ResourceManager]
    resource: str
    kind: Kind
    sizes: tuple[int, ...]  # the unit counts an action may ask for
    spec: dict[str, Any]  # copied into each action's spec


def _cpu() -> CpuManager:
    nodes = tuple(CpuNodeConfig(name=f"n{i}", cores=tuple(range(4)), numa=((0, 1), (2, 3)), memory_mb=1 << 20)
                  for i in range(2))
    manager = CpuManager(CpuConfig(nodes=nodes, malleable=False, max_environments=1 << 20))
    for config in nodes:
        manager.add_node(CpuNode(config, NoSandboxes()))
    return manager


def _gpu() -> GpuManager:
    service = {"backend": "torch", "model": "m", "task": "similarity", "dops": [1, 2, 4], "gpu_memory_mb": 10,
               "host_memory_mb": 10}
    nodes = {f"g{i}": {"gpus": 4, "gpu_memory_mb": 100, "host_memory_mb": 1000, "device_type": "cpu"}
             for i in range(2)}
    return GpuManager(parse_gpu_config({"nodes": nodes, "services": {"s": service}}))


SUBJECTS = {
    "basic": Subject(lambda: BasicManager([BasicResourceConfig("lease.x", concurrency=6)]), "lease.x", Kind.LEASE,
                     (1, 2, 4), {}),
    "counted": Subject(lambda: CountedUnitsManager({"units": {"p0": 4, "p1": 4}}), "units", Kind.EXEC, (1, 2, 4),
                       {"command": "true"}),
    "cpu": Subject(_cpu, "cpu", Kind.EXEC, (1, 2, 4), {"command": "true"}),
    "gpu": Subject(_gpu, "gpu", Kind.REWARD, (1, 2, 4), {"service": "s", "input": {"pairs": [["a", "b"]]}}),
}

#: per action: its size (an index into the subject's sizes) and whether it is elastic up to the largest size
workloads = st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=12)


def actions(subject: Subject, workload: list[tuple[int, bool]]) -> list[Action]:
    made = []
    for seq, (size, elastic) in enumerate(workload, start=1):
        low = subject.sizes[size]
        demand = Demand(tuple(s for s in subject.sizes if s >= low)) if elastic else Demand.fixed(low)
        made.append(Action(task="t", kind=subject.kind, demands={subject.resource: demand}, spec=dict(subject.spec),
                           elasticity=Elasticity(subject.resource, EFFICIENCY, t1=10.0) if elastic else None,
                           id=f"a{seq}", seq=seq))
    return made


def in_use(manager: ResourceManager) -> dict[tuple[str, str], int]:
    return {(row.resource, row.pool): row.in_use for row in manager.status() if row.resource in manager.resources}


@pytest.mark.parametrize("name", sorted(SUBJECTS))
@settings(max_examples=60, deadline=None)
@given(workload=workloads, probes=workloads)
def test_a_refused_try_add_leaves_no_trace(name: str, workload: list[tuple[int, bool]],
                                           probes: list[tuple[int, bool]]) -> None:
    """A fit that saw refusals answers every later probe as one that never saw them."""
    subject = SUBJECTS[name]
    manager = subject.build()
    seen, clean = manager.fit(), manager.fit()
    accepted = [a for a in actions(subject, workload) if seen.try_add(a, a.min_units())]
    assert all(clean.try_add(a, a.min_units()) for a in accepted)
    for probe in actions(subject, probes):
        probe.id = f"probe-{probe.id}"
        assert seen.try_add(probe, probe.min_units()) == clean.try_add(probe, probe.min_units())


@pytest.mark.parametrize("name", sorted(SUBJECTS))
@settings(max_examples=60, deadline=None)
@given(workload=workloads)
def test_release_is_idempotent_and_gives_everything_back(name: str, workload: list[tuple[int, bool]]) -> None:
    subject = SUBJECTS[name]
    manager = subject.build()
    before = in_use(manager)
    fit = manager.fit()
    allocations = []
    for action in actions(subject, workload):
        if fit.try_add(action, action.min_units()):
            pools = {subject.resource: fit.pool_of(action, subject.resource)}
            allocations.append(manager.allocate(action, action.min_units(), pools))
    assert sum(in_use(manager).values()) == sum(sum(a.units.values()) for a in allocations)
    for allocation in allocations:
        manager.release(allocation)
        manager.release(allocation)
    assert in_use(manager) == before


@pytest.mark.parametrize("name", sorted(SUBJECTS))
@settings(max_examples=60, deadline=None)
@given(running=workloads, queued=workloads)
def test_every_plan_the_scheduler_makes_is_allocatable(name: str, running: list[tuple[int, bool]],
                                                       queued: list[tuple[int, bool]]) -> None:
    """Some actions hold units; the scheduler plans the queue (DPArrange over the manager's operator for elastic
    ones); every placement it returns is one the manager can allocate, in order."""
    subject = SUBJECTS[name]
    manager = subject.build()
    scheduler = Scheduler([manager], DurationModel())
    held = []
    fit = manager.fit()
    for action in actions(subject, running):
        if not action.demands[subject.resource].elastic and fit.try_add(action, action.min_units()):
            held.append(manager.allocate(action, action.min_units(),
                                         {subject.resource: fit.pool_of(action, subject.resource)}))
    queue = actions(subject, queued)
    for action in queue:
        action.id = f"q-{action.id}"
    plan = scheduler.schedule(queue, [], 0.0)
    for placement in plan.placements:
        assert placement.units[subject.resource] in placement.action.demands[subject.resource].choices
        held += [allocation for _, allocation in allocate_placement({subject.resource: manager}, placement)]
    for allocation in held:
        manager.release(allocation)
    assert sum(in_use(manager).values()) == 0


def test_an_action_of_another_kind_holding_cores_has_no_exec_spec_to_parse():
    """A reward action may demand cores beside its GPUs: the CPU manager places it without reading its spec as an
    exec spec (which it is not, and which would fail to parse in the middle of a scheduling pass)."""
    manager = _cpu()
    action = Action(task="t", kind=Kind.REWARD, demands={"cpu": Demand.fixed(1)}, trajectory="tr",
                    spec={"service": "s", "input": {"pairs": [["a", "b"]]}})
    assert manager.fit().try_add(action, {"cpu": 1})
    assert manager.environment_demand(action) is None and manager.environment_of(action) is None


def test_the_seam_keeps_to_its_verbs() -> None:
    """A feature that needs more from a manager adds a plugin (``CyclePlugins``) or a capability object
    (``Resizing``), not another method every manager and the broker must know by name."""
    methods = {name for name, value in vars(ResourceManager).items()
               if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    assert methods == {"resources", "largest_pool", "fit", "allocate", "release", "resizing", "execute", "validate",
                       "status", "plugins", "start", "close"}
