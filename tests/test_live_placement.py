"""The live placement (``managers/gpu/live_placement.py``): when it solves (first poll, interval, ``stale()``, never
without load), what it confines (only services with load), the previous placement passed on, the worker thread's
solve applied at a later poll, measured speeds overriding the prior (also through ``place(..., speeds=...)``), and
the Prometheus families ``PlacementCollector`` exposes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Mapping

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from managers.gpu.config import GpuNodeConfig
from managers.gpu.gpu_types import GPU_TYPES
from managers.gpu.live_placement import LivePlacement, PlacementCollector, PlacementInput, ServiceFigures, SolveMethod
from managers.gpu.placement import Placement, place, place_greedy
from managers.gpu.placement_problem import ServiceLoad, node_groups
from managers.gpu.service_demand import ServiceDemand
from tangram.core.action import Action, Demand, Kind

WINDOW_S = 60.0
INTERVAL_S = 30.0
#: an H100 and an H20 node, each with host memory for one big copy (and a small one)
NODES = (GpuNodeConfig(name="a", gpus=4, gpu_memory_mb=80 * 1024, host_memory_mb=15_000, type="h100"),
         GpuNodeConfig(name="b", gpus=4, gpu_memory_mb=96 * 1024, host_memory_mb=15_000, type="h20"))
NODE_TYPES = {node.name: node.type for node in NODES}
#: the prior puts the compute-bound scorer on H100 (H20 has 0.15 of its TFLOPS) and the memory-bound writer on H20;
#: ``idle`` never gets an action
SERVICES = (ServiceFigures("scorer", host_memory_mb=10_000, gpu_memory_mb=8_000, bound="compute"),
            ServiceFigures("writer", host_memory_mb=10_000, gpu_memory_mb=8_000, bound="memory"),
            ServiceFigures("idle", host_memory_mb=1_000, gpu_memory_mb=8_000, bound="compute"))


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Applied:
    """The ``apply`` callback: every confinement it was given."""

    def __init__(self) -> None:
        self.calls: list[dict[str, tuple[str, ...]]] = []

    def __call__(self, confined: Mapping[str, Iterable[str]]) -> None:
        self.calls.append({service: tuple(groups) for service, groups in confined.items()})


class Recording(LivePlacement):
    """Records each solve's input and thread; fails the solves listed in ``fail``."""

    def __init__(self, clock: Clock, watcher: ServiceDemand, method: SolveMethod, inline: bool,
                 fail: tuple[int, ...]) -> None:
        super().__init__(method, watcher, INTERVAL_S, 10.0, clock, inline=inline)
        self.inputs: list[PlacementInput] = []
        self.threads: list[str] = []
        self.fail = fail

    def solve(self, inputs: PlacementInput) -> Placement:
        self.inputs.append(inputs)
        self.threads.append(threading.current_thread().name)
        if len(self.inputs) in self.fail:
            raise RuntimeError("solver crashed")
        return super().solve(inputs)


def demand() -> ServiceDemand:
    return ServiceDemand(lambda action: action.spec["service"], NODE_TYPES.get, GPU_TYPES,
                         {s.name: s.bound for s in SERVICES}, WINDOW_S)


def reward(service: str, at: float) -> Action:
    return Action(task="t", kind=Kind.REWARD, demands={"gpu": Demand((1,))}, spec={"service": service},
                  submitted_at=at)


def busy(watcher: ServiceDemand, *services: str, until: float = WINDOW_S) -> None:
    """One arrival a second of each of ``services`` (named twice: two) from 0 until ``until``, in time order."""
    for second in range(int(until)):
        for service in services:
            watcher.submitted(reward(service, float(second)))


def ran(watcher: ServiceDemand, service: str, node: str, execution_s: float) -> None:
    action = reward(service, 0.0)
    action.execution_s, action.units, action.placement = execution_s, {"gpu": 1}, {"gpu": {"node": node}}
    watcher.ended(action)


def live(clock: Clock, watcher: ServiceDemand | None = None, method: SolveMethod = "ilp", inline: bool = True,
         fail: tuple[int, ...] = ()) -> Recording:
    return Recording(clock, watcher or demand(), method, inline, fail)


def poll(placement: LivePlacement, apply: Applied) -> None:
    placement.poll(SERVICES, NODES, GPU_TYPES, apply)


@pytest.mark.parametrize("method", ["ilp", "greedy"])
def test_the_first_poll_solves_and_confines_only_the_services_with_load(method: SolveMethod) -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock, method=method)
    busy(placing.demand, "scorer", "writer")
    poll(placing, apply)
    assert apply.calls == [{"scorer": ("h100",), "writer": ("h20",)}]
    assert placing.placement is not None and placing.placement.method == method
    assert placing.placement.variants("idle")  # the solver gives it a variant; the manager leaves it free
    assert placing.solves == {method: 1}
    assert placing.loads["idle"] == 0.0 and placing.loads["scorer"] == pytest.approx(1.0, rel=0.01)
    assert placing.describe("scorer") == {"load": round(placing.loads["scorer"], 6), "types": {"h100": 4.0},
                                          "confined": True}
    assert placing.describe("idle")["confined"] is False and placing.describe("idle")["load"] == 0.0
    assert placing.describe("unknown") == {"load": 0.0, "types": {}, "confined": False}
    (inputs,) = placing.inputs
    assert [s.name for s in inputs.services] == ["scorer", "writer", "idle"]
    assert {g.name: g.gpus for g in inputs.groups} == {"h100": 4, "h20": 4}
    assert inputs.current == {}  # nothing in force yet
    assert inputs.speeds[("scorer", "h20")] == pytest.approx(148 / 989)  # nothing measured: the prior


def test_it_solves_again_only_after_the_interval_or_when_stale() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock)
    busy(placing.demand, "scorer", "writer")
    poll(placing, apply)
    clock.now += INTERVAL_S - 1
    poll(placing, apply)
    assert len(placing.inputs) == 1 and len(apply.calls) == 1
    clock.now += 1
    poll(placing, apply)
    assert len(placing.inputs) == 2 and len(apply.calls) == 2
    clock.now += 1
    poll(placing, apply)
    assert len(placing.inputs) == 2
    placing.stale()  # services added, a node lost or joined: solve at the next pass
    poll(placing, apply)
    assert len(placing.inputs) == 3 and len(apply.calls) == 3
    poll(placing, apply)  # and then the interval again
    assert len(placing.inputs) == 3
    assert placing.solves == {"ilp": 3}


def test_the_placement_in_force_is_passed_to_the_next_solve() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock)
    busy(placing.demand, "scorer", "writer")
    poll(placing, apply)
    first = placing.placement
    assert first is not None
    clock.now += INTERVAL_S
    poll(placing, apply)
    assert placing.inputs[1].current == {name: first.variants(name) for name in first.shares}
    assert placing.inputs[1].current["scorer"] == ("h100",)


def test_no_load_no_solve() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock)
    poll(placing, apply)
    assert placing.inputs == [] and apply.calls == [] and placing.placement is None
    assert placing.loads == {"scorer": 0.0, "writer": 0.0, "idle": 0.0} and placing.solves == {}
    placing.stale()
    placing.poll((), NODES, GPU_TYPES, apply)  # no services at all
    assert placing.inputs == [] and apply.calls == []


def test_demand_that_dies_away_lets_every_service_run_anywhere_again() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock)
    busy(placing.demand, "scorer", "writer")
    poll(placing, apply)
    assert apply.calls[-1] == {"scorer": ("h100",), "writer": ("h20",)}
    clock.now += 1e6  # silence for far longer than the window: every load decays to nothing
    poll(placing, apply)
    assert apply.calls[-1] == {} and placing.placement is None
    assert placing.describe("scorer")["confined"] is False


def test_a_service_gone_idle_is_left_free_while_the_others_stay_placed() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock)
    busy(placing.demand, "scorer", "writer")
    for second in range(int(WINDOW_S), int(11 * WINDOW_S)):  # ten windows of the writer alone
        placing.demand.submitted(reward("writer", float(second)))
    clock.now = 11 * WINDOW_S
    placing.stale()
    poll(placing, apply)
    assert 0 < placing.demand.load("scorer", clock.now) < 1e-3 * placing.demand.load("writer", clock.now)
    assert placing.loads["scorer"] == 0.0 and apply.calls[-1] == {"writer": ("h20",)}


def test_measured_speeds_invert_the_priors_placement() -> None:
    """Measured: the scorer runs twice as fast on H20 as on H100, the writer half as fast; with room for one big
    copy per node, the scorer goes to H20 and the writer to H100, against the prior."""
    clock, apply = Clock(WINDOW_S), Applied()
    watcher = demand()
    for node, scorer_s, writer_s in (("a", 1.0, 1.0), ("b", 0.5, 2.0)):
        ran(watcher, "scorer", node, scorer_s)
        ran(watcher, "writer", node, writer_s)
    placing = live(clock, watcher)
    busy(watcher, "scorer", "writer")
    poll(placing, apply)
    assert placing.inputs[0].speeds[("scorer", "h20")] == pytest.approx(2.0)
    assert placing.inputs[0].speeds[("writer", "h20")] == pytest.approx(0.5)
    assert apply.calls == [{"scorer": ("h20",), "writer": ("h100",)}]


@pytest.mark.parametrize("solver", [place, place_greedy])
def test_place_takes_sound_measured_speeds_over_the_prior(solver: Callable[..., Placement]) -> None:
    groups = node_groups(NODES, GPU_TYPES)
    services = [ServiceLoad(s.name, 1.0, s.host_memory_mb, s.gpu_memory_mb, s.bound) for s in SERVICES[:2]]
    prior = solver(services, groups)
    assert (prior.variants("scorer"), prior.variants("writer")) == (("h100",), ("h20",))
    measured = solver(services, groups, speeds={("scorer", "h20"): 2.0, ("writer", "h20"): 0.5})
    assert (measured.variants("scorer"), measured.variants("writer")) == (("h20",), ("h100",))
    assert measured.objective == pytest.approx(4.0)  # the writer on 4 H100s at speed 1
    # figures that are not positive and finite are ignored: the prior decides (with 0 for the scorer on H100 it
    # could not run there at all)
    unsound = solver(services, groups, speeds={("scorer", "h20"): float("nan"), ("writer", "h20"): -1.0,
                                               ("scorer", "h100"): 0.0, ("writer", "h100"): float("inf")})
    assert (unsound.variants("scorer"), unsound.variants("writer")) == (("h100",), ("h20",))
    assert unsound.objective == pytest.approx(prior.objective)


def test_on_a_worker_thread_the_solve_is_applied_at_a_later_poll() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock, inline=False)
    try:
        busy(placing.demand, "scorer", "writer")
        poll(placing, apply)
        assert apply.calls == [] and placing.placement is None
        pending = placing._pending
        assert pending is not None
        pending.result(timeout=10)
        assert apply.calls == []  # nothing is applied off the scheduling pass
        poll(placing, apply)
        assert apply.calls == [{"scorer": ("h100",), "writer": ("h20",)}]
        assert placing.placement is not None and placing._pending is None
        assert len(placing.inputs) == 1 and placing.threads[0].startswith("tangram-placement")
        assert placing.threads[0] != threading.current_thread().name
    finally:
        placing.close()
    assert placing._executor is None
    placing.close()  # twice is harmless


async def test_in_an_event_loop_the_workers_solve_is_applied_as_soon_as_it_ends() -> None:
    """The broker's case: nothing waits for the next scheduling pass (an idle broker may have none for long)."""
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock, inline=False)
    try:
        busy(placing.demand, "scorer", "writer")
        poll(placing, apply)
        assert apply.calls == []
        for _ in range(1000):  # bounded: the solve takes milliseconds
            if apply.calls:
                break
            await asyncio.sleep(0.01)
        assert apply.calls == [{"scorer": ("h100",), "writer": ("h20",)}] and placing._pending is None
    finally:
        placing.close()


def test_a_failed_solve_on_the_worker_leaves_the_placement_in_force() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock, inline=False, fail=(2,))
    try:
        busy(placing.demand, "scorer", "writer")
        for _ in range(2):  # the first solve, applied; then the second, which fails
            poll(placing, apply)
            assert placing._pending is not None
            placing._pending.exception(timeout=10)
            clock.now += INTERVAL_S
        first = placing.placement
        poll(placing, apply)  # takes the failure, starts a third solve
        assert placing.placement is first and first is not None and len(apply.calls) == 1
        assert placing._pending is not None
        placing._pending.result(timeout=10)
        clock.now += 1
        poll(placing, apply)
        assert len(apply.calls) == 2 and placing.placement is not first and placing.solves == {"ilp": 2}
    finally:
        placing.close()


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_collector_exposes_solves_loads_objective_and_shares() -> None:
    clock, apply = Clock(WINDOW_S), Applied()
    placing = live(clock)
    registry = CollectorRegistry()
    registry.register(PlacementCollector(placing))
    before = generate_latest(registry).decode()
    assert "tangram_gpu_placement_objective" not in before and "tangram_gpu_placement_share" not in before
    busy(placing.demand, "scorer", "writer", "writer")  # the writer twice the scorer's load
    poll(placing, apply)
    text = generate_latest(registry).decode()
    for family in ("tangram_gpu_placement_solves_total", "tangram_gpu_service_load", "tangram_gpu_placement_objective",
                   "tangram_gpu_placement_share", "tangram_gpu_placement_solve_seconds"):
        assert family in text
    found = samples(registry)
    assert placing.placement is not None
    assert found[("tangram_gpu_placement_solves_total", (("method", "ilp"),))] == 1.0
    assert found[("tangram_gpu_service_load", (("service", "scorer"),))] == pytest.approx(placing.loads["scorer"])
    assert found[("tangram_gpu_service_load", (("service", "writer"),))] == pytest.approx(
        2 * placing.loads["scorer"])
    assert found[("tangram_gpu_service_load", (("service", "idle"),))] == 0.0
    assert found[("tangram_gpu_placement_objective", ())] == pytest.approx(placing.placement.objective)
    shares = {dict(labels)["service"] + "@" + dict(labels)["type"]: value for (name, labels), value in found.items()
              if name == "tangram_gpu_placement_share"}
    assert shares == pytest.approx({f"{service}@{group}": gpus for service, groups in placing.placement.shares.items()
                                    for group, gpus in groups.items()})
    assert shares["scorer@h100"] > 0 and "scorer@h20" not in shares
