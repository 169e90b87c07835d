"""Which reward services have a variant on which GPU node group, and how much of each group's time each gets.

A group is the nodes of one GPU type. A service may run on a group only where it has a variant there: its host copy
on each of the group's nodes (each variant costs host memory and restores). The placement maximises the common
factor ``t`` by which every service's load is served (max-min throughput) and, among placements within
``TIE_BREAK`` of that, keeps fewer variants. With ``S`` services, ``G`` groups and ``E`` the (service, group) pairs
a service fits (its memory per GPU within the type's, its host copy within a node's host memory), the ILP is::

    maximise    t/scale - sum_E p[s,g] * x[s,g]             (p: TIE_BREAK / |E|, half for a variant kept)
    subject to  sum_g speed[s,g] * a[s,g] >= t * load[s]    for every service with load > 0
                sum_s a[s,g] <= gpus[g]                     for every group
                a[s,g] <= m[s,g] * x[s,g]                   for every pair in E
                sum_s host[s] * x[s,g] <= host[g]           for every group (per node: each node holds the copies)
                sum_g x[s,g] >= 1                           for every service (each can run somewhere)
                a >= 0, x binary, 0 <= t <= t_high

``a[s,g]`` is GPUs' worth of group ``g``'s time given to ``s``; ``speed`` comes from ``managers/gpu/gpu_types.py``, or
where given, from speeds measured (``speeds``, ``managers/gpu/service_demand.py``);
``load`` is GPU-seconds per second on the reference type; ``host[g]`` a node's host memory. ``t_high`` bounds the
optimum (the LP relaxation's ``t``, tightened by re-solving with it), so ``m[s,g] = min(gpus[g], t_high * load[s] /
speed[s,g])``: serving a service more than ``t`` times its load never helps, and the tighter ``m`` makes host memory
bind in the relaxation too. ``scale`` is the ``t`` of the greedy's first dive, so the tie-break gives up at most
``TIE_BREAK`` of ``t``. HiGHS solves it (``scipy.optimize.milp``) under a time limit, to a relative gap of
``TIE_BREAK / 10`` (which may leave a variant or two the tie-break would drop). Bad input, an infeasible ILP, a
solver failure, or a time limit without a solution as good as that dive's falls back to the greedy
(``placement_greedy.py``: two dives through the relaxation, then a local search of LP-checked moves) with the
reason logged; nothing here raises on its input. Max-min leaves time that no bottleneck needs: each group's is
shared out among its variants at the end. The input and its arrays are in ``placement_problem.py``, the ILP's model
in ``placement_model.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from managers.gpu.gpu_types import GpuType
from managers.gpu.placement_greedy import dive, greedy, round_variants
from managers.gpu.placement_model import TIE_BREAK, bound_on_t, lp_relaxation, solve_ilp
from managers.gpu.placement_problem import (
    Matrix,
    NodeGroup,
    ProblemInstance,
    ServiceLoad,
    Speeds,
    problem_instance,
    proportional,
    throughput,
)

log = logging.getLogger("managers.gpu.placement")  # one logger for the placement, whichever module answers

Method = Literal["ilp", "greedy", "type-blind"]


@dataclass(frozen=True)
class Placement:
    """Where each service may run and with how much GPU time, how good that is (``t``) and how it was found."""

    method: Method
    #: service -> {group with a variant of it: GPUs' worth of that group's time it gets (0 for a service without
    #: load)}
    shares: Mapping[str, Mapping[str, float]]
    #: the factor by which every service's load is served (``inf`` when no service has load)
    objective: float
    solve_s: float
    #: why the ILP's answer is not the one given (bad input, infeasible, solver failure, time limit); None if it is
    fallback: str | None = None
    #: services given no variant: bad figures, or no group they fit with room for their host copy
    unplaced: tuple[str, ...] = ()
    #: the ILP proved its answer optimal (up to the tie-break and HiGHS's gap)
    optimal: bool = False

    def variants(self, service: str) -> tuple[str, ...]:
        return tuple(self.shares.get(service, {}))

    @property
    def variant_count(self) -> int:
        return sum(len(groups) for groups in self.shares.values())


def place(services: Iterable[ServiceLoad], groups: Iterable[NodeGroup], reference: GpuType | None = None,
          time_limit_s: float = 1.0, current: Mapping[str, Iterable[str]] | None = None,
          speeds: Speeds | None = None) -> Placement:
    """The ILP's placement, or the greedy's with the reason when the ILP cannot give one; ``solve_s`` is the whole
    call's (the bound, one dive of the greedy, the ILP, and the rest of the greedy when it falls back). ``current``
    (service -> groups with a variant now) halves the tie-break's cost of keeping those, so a re-solve moves less.
    ``speeds`` ((service, group) -> times faster than on the reference type, measured) replaces the cost model's
    prior where it gives a sound figure."""
    started = time.perf_counter()
    instance, problems = problem_instance(tuple(services), tuple(groups), reference, speeds)
    t_high = bound_on_t(instance)
    relaxation = lp_relaxation(instance, t_high)
    dive_x, dive_a = dive(instance, relaxation, look_ahead=False)  # the tie-break's scale, and a bar for the ILP
    dive_t = throughput(instance, dive_x, dive_a)
    reason = "; ".join(problems) if problems else None
    if reason is None:
        answer = solve_ilp(instance, dive_t, t_high, time_limit_s, current or {})
        if isinstance(answer, str):
            reason = answer
        else:
            ilp_x, ilp_a, optimal = answer
            ilp_t = throughput(instance, ilp_x, ilp_a)
            if optimal or ilp_t >= dive_t * (1 - TIE_BREAK):
                return _placement("ilp", instance, ilp_x, ilp_a, started, optimal=optimal)
            reason = f"the ILP's best within {time_limit_s} s (t={ilp_t:.4g}) is worse than the greedy's dive's"
    log.warning("GPU placement falls back to the greedy: %s", reason)
    greedy_x, greedy_a = greedy(instance, relaxation, t_high)
    return _placement("greedy", instance, greedy_x, greedy_a, started, fallback=reason)


def place_greedy(services: Iterable[ServiceLoad], groups: Iterable[NodeGroup],
                 reference: GpuType | None = None, speeds: Speeds | None = None) -> Placement:
    """The greedy alone (``greedy``); services with bad figures or no room are reported unplaced."""
    started = time.perf_counter()
    instance, _ = problem_instance(tuple(services), tuple(groups), reference, speeds)
    t_high = bound_on_t(instance)
    x, a = greedy(instance, lp_relaxation(instance, t_high), t_high)
    return _placement("greedy", instance, x, a, started)


def place_type_blind(services: Iterable[ServiceLoad], groups: Iterable[NodeGroup],
                     reference: GpuType | None = None) -> Placement:
    """The baseline that ignores types: one variant of each service where most host memory is left, then one on
    every other group it fits (in decreasing load, while host memory lasts); each group's GPU time shared in
    proportion to load whatever the speeds."""
    started = time.perf_counter()
    instance, _ = problem_instance(tuple(services), tuple(groups), reference)
    by_load = np.repeat(instance.load[:, None], len(instance.groups), axis=1)
    x = round_variants(instance, np.zeros_like(instance.speed), np.zeros_like(instance.allowed), instance.allowed,
                       by_load)
    return _placement("type-blind", instance, x, proportional(instance, x, by_load), started)


def _placement(method: Method, instance: ProblemInstance, x: NDArray[np.bool_], a: Matrix, started: float,
               fallback: str | None = None, optimal: bool = False) -> Placement:
    """The answer, with each group's time left over (max-min leaves what no bottleneck needs) shared among its
    variants in proportion to their shares: ``t`` cannot fall, and no GPU idles while a variant could use it."""
    a = np.where(x, a, 0.0)
    used = a.sum(axis=0)
    a = np.divide(a * instance.gpus, used, out=a, where=used > 0)
    shares = {name: {instance.groups[g]: float(a[s, g]) for g in np.flatnonzero(x[s])}
              for s, name in enumerate(instance.services) if x[s].any()}
    unplaced = instance.unplaced + tuple(name for name in instance.services if name not in shares)
    return Placement(method=method, shares=shares, objective=throughput(instance, x, a),
                     solve_s=time.perf_counter() - started, fallback=fallback, unplaced=unplaced, optimal=optimal)
