"""The GPU manager's own placement of reward services over its node groups (issue 18), re-solved as demand moves.

Every ``interval_s``, and at once after services are added or nodes leave or join, the placement of
``placement.py`` is solved again over the groups of the nodes in service, from the loads and speeds that
``ServiceDemand`` measures, and each service is confined to the nodes of the groups where it gets a variant
(``GpuManager.place_services``). A service with no measured load is left free to run anywhere: a placement never
decides from nothing. The previous variants are passed to the solver, which keeps them when that costs nothing, so
a re-solve moves little. In the broker the solve runs on a worker thread (HiGHS may take up to its time limit)
and is applied on the event loop as soon as it ends; the simulator solves inline on its virtual clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from managers.gpu.gpu_types import Bound, GpuType
from managers.gpu.placement import Placement, place, place_greedy
from managers.gpu.placement_problem import NodeGroup, ServiceLoad, TypedNode, node_groups
from managers.gpu.service_demand import ServiceDemand

log = logging.getLogger("tangram.gpu")

SolveMethod = Literal["ilp", "greedy"]
#: a service whose measured load is below this share of all of them is placed as one without load (left free):
#: the load of a service gone idle decays but never reaches zero
NEGLIGIBLE_LOAD_SHARE = 1e-3


@dataclass(frozen=True)
class PlacementInput:
    """One solve's input, read on the event loop so that the solve itself touches nothing shared."""

    services: tuple[ServiceLoad, ...]
    groups: tuple[NodeGroup, ...]
    speeds: Mapping[tuple[str, str], float]
    current: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class ServiceFigures:
    """What the placement is given of one service (``ServiceSpec``'s sizes and the bound of its task)."""

    name: str
    host_memory_mb: float
    gpu_memory_mb: float
    bound: Bound


class LivePlacement:
    """When to solve, the solve, and what its answer confines."""

    def __init__(self, method: SolveMethod, demand: ServiceDemand, interval_s: float, time_limit_s: float,
                 clock: Callable[[], float], inline: bool = False) -> None:
        self.method = method
        self.demand = demand
        self.interval_s = interval_s
        self.time_limit_s = time_limit_s
        self._clock = clock
        self._inline = inline
        self._next_at = -math.inf
        self._pending: concurrent.futures.Future[Placement] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        #: the placement in force and the loads it was solved for (None until the first solve)
        self.placement: Placement | None = None
        self.loads: dict[str, float] = {}
        self.solves: dict[str, int] = {}

    def stale(self) -> None:
        """Services or nodes changed: solve again at the next pass."""
        self._next_at = -math.inf

    def poll(self, services: Iterable[ServiceFigures], nodes: Iterable[TypedNode], types: Mapping[str, GpuType],
             apply: Callable[[Mapping[str, Iterable[str]]], None]) -> None:
        """Called at every scheduling pass: apply a solve that ended, start one when it is due. ``apply`` gets
        service -> the group (type) names it may run on, for the services with load."""
        self._collect(apply)
        if self._pending is not None:
            return
        now = self._clock()
        if now < self._next_at:
            return
        self._next_at = now + self.interval_s
        figures = tuple(services)
        loads = {s.name: self.demand.load(s.name, now) for s in figures}
        floor = NEGLIGIBLE_LOAD_SHARE * sum(loads.values())
        loads = {name: load if load > floor else 0.0 for name, load in loads.items()}
        self.loads = loads
        if not any(loads.values()):  # demand died away: nothing to place from, every service runs anywhere
            if self.placement is not None:
                self.placement = None
                apply({})
            return
        groups = node_groups(nodes, types)
        inputs = PlacementInput(
            services=tuple(ServiceLoad(s.name, loads[s.name], s.host_memory_mb, s.gpu_memory_mb, s.bound)
                           for s in figures),
            groups=groups,
            speeds={(s.name, g.name): self.demand.speed(s.name, g.name) for s in figures for g in groups},
            current={name: self.placement.variants(name) for name in self.placement.shares}
            if self.placement is not None else {})
        if self._inline:
            self._adopt(self.solve(inputs), apply)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tangram-placement")
        self._pending = pending = self._executor.submit(self.solve, inputs)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven without an event loop: the next poll applies it
            return

        def ended(_: object) -> None:  # on the worker thread: apply it on the loop, without waiting for a pass
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._collect, apply)
        pending.add_done_callback(ended)

    def _collect(self, apply: Callable[[Mapping[str, Iterable[str]]], None]) -> None:
        """Apply the worker's solve if it has ended."""
        if self._pending is None or not self._pending.done():
            return
        answer, self._pending = self._pending, None
        try:
            self._adopt(answer.result(), apply)
        except Exception:  # a failed solve leaves the placement in force; the next one retries
            log.exception("GPU placement: the solve failed; the placement in force stays")

    def solve(self, inputs: PlacementInput) -> Placement:
        if self.method == "ilp":
            return place(inputs.services, inputs.groups, time_limit_s=self.time_limit_s, current=inputs.current,
                         speeds=inputs.speeds)
        return place_greedy(inputs.services, inputs.groups, speeds=inputs.speeds)

    def _adopt(self, placement: Placement, apply: Callable[[Mapping[str, Iterable[str]]], None]) -> None:
        self.placement = placement
        self.solves[placement.method] = self.solves.get(placement.method, 0) + 1
        apply({service: placement.variants(service) for service in placement.shares
               if self.loads.get(service, 0.0) > 0})
        log.info("GPU placement (%s, %.3f s, t=%.3g): %s", placement.method, placement.solve_s, placement.objective,
                 "; ".join(f"{s} on {', '.join(g)}" for s, g in sorted(
                     (s, placement.variants(s)) for s in placement.shares)) or "nothing placed")

    def describe(self, service: str) -> dict[str, object]:
        """A service's part of the placement in force (``GET /v1/services``)."""
        shares = self.placement.shares.get(service, {}) if self.placement is not None else {}
        return {"load": round(self.loads.get(service, 0.0), 6),
                "types": {group: round(gpus, 3) for group, gpus in shares.items()},
                "confined": bool(shares) and self.loads.get(service, 0.0) > 0}

    def summary(self) -> dict[str, object]:
        """The placement in force, how it was found and each service's part (``GET /v1/resources``)."""
        placement = self.placement
        return {"method": self.method, "solves": dict(self.solves),
                "answered_by": placement.method if placement is not None else None,
                "objective": placement.objective if placement is not None and math.isfinite(placement.objective)
                else None,
                "solve_s": placement.solve_s if placement is not None else None,
                "fallback": placement.fallback if placement is not None else None,
                "services": [{"service": service, **self.describe(service)} for service in sorted(self.loads)]}

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class PlacementCollector(Collector):
    """``/metrics``: the placement in force and the demand it was solved for."""

    def __init__(self, live: LivePlacement) -> None:
        self.live = live

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        live = self.live
        solves = CounterMetricFamily("tangram_gpu_placement_solves", "GPU placements solved, by the method that "
                                     "gave the answer (greedy when the ILP fell back)", labels=["method"])
        for method, count in live.solves.items():
            solves.add_metric([method], count)
        yield solves
        load = GaugeMetricFamily("tangram_gpu_service_load", "A reward service's measured demand, GPU-seconds per "
                                 "second on the reference GPU type", labels=["service"])
        for service, value in live.loads.items():
            load.add_metric([service], value)
        yield load
        placement = live.placement
        if placement is None:
            return
        yield GaugeMetricFamily("tangram_gpu_placement_solve_seconds", "Wall time of the last placement solve",
                                value=placement.solve_s)
        if math.isfinite(placement.objective):
            yield GaugeMetricFamily("tangram_gpu_placement_objective", "The last placement's t: the factor by which "
                                    "every service's measured load is served", value=placement.objective)
        share = GaugeMetricFamily("tangram_gpu_placement_share", "GPUs' worth of a GPU type's time the last "
                                  "placement gives a service", labels=["service", "type"])
        for service, groups in placement.shares.items():
            for group, gpus in groups.items():
                share.add_metric([service, group], gpus)
        yield share
