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
solver failure, or a time limit without a solution as good as that dive's falls back to the greedy (``_greedy``:
two dives through the relaxation, then a local search of LP-checked moves) with the reason logged; nothing here
raises on its input. Max-min leaves time that no bottleneck needs: each group's is shared out among
its variants at the end.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from managers.gpu.gpu_types import GPU_TYPES, REFERENCE_TYPE, Bound, GpuType, fits, speed

log = logging.getLogger(__name__)

Method = Literal["ilp", "greedy", "type-blind"]
Matrix = NDArray[np.float64]
#: (service, group) -> times faster than on the reference type
Speeds = Mapping[tuple[str, str], float]

#: the share of ``t`` the ILP may give up, over all variants together, to keep fewer of them
TIE_BREAK = 1e-3
#: at most this many LPs (a few ms each at 20 services x 6 types) in the greedy's relocation search
RELOCATION_LPS = 200
#: a host copy this large a share of a group's host memory makes the greedy's dive try each of its service's groups
#: before fixing one (``_look_ahead``)
LOOK_AHEAD_SHARE = 0.25
#: the relocation search adds variants for this many of the least served services; it moves every service's
#: variants, those of the largest host copies first (a large copy on a fast group is what keeps others off it)
RELOCATION_ADDERS = 3
#: once no single move improves, the relocation search tries at most this many exchanges of two copies too large to
#: share a node, each a dive (about one LP per variant): neither copy can move alone, as it would evict the other
RELOCATION_EXCHANGES = 1


@dataclass(frozen=True)
class ServiceLoad:
    """What the placement needs of one service."""

    name: str
    load: float  # GPU-seconds per second it needs on the reference type
    host_memory_mb: float  # one host copy of its weights
    gpu_memory_mb: float  # per GPU of one instance
    bound: Bound = "compute"


@dataclass(frozen=True)
class NodeGroup:
    """The nodes of one GPU type."""

    name: str
    kind: GpuType
    gpus: int  # over all its nodes
    host_memory_mb: float  # per node (the smallest node's): every node holds the host copies of the variants


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


class TypedNode(Protocol):
    """What ``node_groups`` reads of a node's config (``GpuNodeConfig``)."""

    @property
    def type(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def gpu_memory_mb(self) -> int: ...
    @property
    def host_memory_mb(self) -> int: ...


def node_groups(nodes: Iterable[TypedNode], types: Mapping[str, GpuType]) -> tuple[NodeGroup, ...]:
    """Nodes (sized, as ``on_this_host`` leaves them) grouped by type: GPUs summed, the smallest node's host memory,
    and the type's memory per GPU narrowed to the smallest node's budget, which is what the manager enforces."""
    by_type: dict[str, list[TypedNode]] = {}
    for node in nodes:
        by_type.setdefault(node.type, []).append(node)
    return tuple(NodeGroup(name, replace(types[name], memory_mb=min([types[name].memory_mb] +
                                                                    [n.gpu_memory_mb for n in members
                                                                     if n.gpu_memory_mb])),
                           gpus=sum(n.gpus for n in members), host_memory_mb=min(n.host_memory_mb for n in members))
                 for name, members in by_type.items())


@dataclass(frozen=True)
class _Instance:
    """The services and groups with sound figures, as arrays; ``speed`` is 0 on the pairs a service does not fit."""

    services: tuple[str, ...]
    groups: tuple[str, ...]
    load: Matrix
    host: Matrix
    speed: Matrix
    gpus: Matrix
    host_room: Matrix
    unplaced: tuple[str, ...]

    @property
    def allowed(self) -> NDArray[np.bool_]:
        return self.speed > 0


def place(services: Iterable[ServiceLoad], groups: Iterable[NodeGroup], reference: GpuType | None = None,
          time_limit_s: float = 1.0, current: Mapping[str, Iterable[str]] | None = None,
          speeds: Speeds | None = None) -> Placement:
    """The ILP's placement, or the greedy's with the reason when the ILP cannot give one; ``solve_s`` is the whole
    call's (the bound, one dive of the greedy, the ILP, and the rest of the greedy when it falls back). ``current``
    (service -> groups with a variant now) halves the tie-break's cost of keeping those, so a re-solve moves less.
    ``speeds`` ((service, group) -> times faster than on the reference type, measured) replaces the cost model's
    prior where it gives a sound figure."""
    started = time.perf_counter()
    instance, problems = _instance(tuple(services), tuple(groups), reference, speeds)
    t_high = _t_high(instance)
    relaxation = _relaxation(instance, t_high)
    dive_x, dive_a = _dive(instance, relaxation, look_ahead=False)  # the tie-break's scale, and a bar for the ILP
    dive_t = _throughput(instance, dive_x, dive_a)
    reason = "; ".join(problems) if problems else None
    if reason is None:
        answer = _ilp(instance, dive_t, t_high, time_limit_s, current or {})
        if isinstance(answer, str):
            reason = answer
        else:
            ilp_x, ilp_a, optimal = answer
            ilp_t = _throughput(instance, ilp_x, ilp_a)
            if optimal or ilp_t >= dive_t * (1 - TIE_BREAK):
                return _placement("ilp", instance, ilp_x, ilp_a, started, optimal=optimal)
            reason = f"the ILP's best within {time_limit_s} s (t={ilp_t:.4g}) is worse than the greedy's dive's"
    log.warning("GPU placement falls back to the greedy: %s", reason)
    greedy_x, greedy_a = _greedy(instance, relaxation, t_high)
    return _placement("greedy", instance, greedy_x, greedy_a, started, fallback=reason)


def place_greedy(services: Iterable[ServiceLoad], groups: Iterable[NodeGroup],
                 reference: GpuType | None = None, speeds: Speeds | None = None) -> Placement:
    """The greedy alone (``_greedy``); services with bad figures or no room are reported unplaced."""
    started = time.perf_counter()
    instance, _ = _instance(tuple(services), tuple(groups), reference, speeds)
    t_high = _t_high(instance)
    x, a = _greedy(instance, _relaxation(instance, t_high), t_high)
    return _placement("greedy", instance, x, a, started)


def place_type_blind(services: Iterable[ServiceLoad], groups: Iterable[NodeGroup],
                     reference: GpuType | None = None) -> Placement:
    """The baseline that ignores types: one variant of each service where most host memory is left, then one on
    every other group it fits (in decreasing load, while host memory lasts); each group's GPU time shared in
    proportion to load whatever the speeds."""
    started = time.perf_counter()
    instance, _ = _instance(tuple(services), tuple(groups), reference)
    by_load = np.repeat(instance.load[:, None], len(instance.groups), axis=1)
    x = _round(instance, np.zeros_like(instance.speed), np.zeros_like(instance.allowed), instance.allowed, by_load)
    return _placement("type-blind", instance, x, _proportional(instance, x, by_load), started)


def _instance(services: tuple[ServiceLoad, ...], groups: tuple[NodeGroup, ...], reference: GpuType | None,
              speeds: Speeds | None = None) -> tuple[_Instance, list[str]]:
    """The sound part of the input and what is wrong with the rest (each problem in words)."""
    base = reference or GPU_TYPES[REFERENCE_TYPE]
    problems: list[str] = []
    if not _positive(base.tflops, base.hbm_gb_per_s, base.h2d_gb_per_s, base.memory_mb):
        problems.append(f"the reference type has bad figures ({base})")
        groups = ()
    good_groups = []
    for group in groups:
        kind = group.kind
        if not (_positive(kind.tflops, kind.hbm_gb_per_s, kind.h2d_gb_per_s, kind.memory_mb)
                and _non_negative(group.gpus, group.host_memory_mb)):
            problems.append(f"group {group.name} has bad figures ({group})")
        else:
            good_groups.append(group)
    good, unplaced = [], []
    for service in services:
        if not _non_negative(service.load, service.host_memory_mb, service.gpu_memory_mb):
            problems.append(f"service {service.name} has bad figures ({service})")
            unplaced.append(service.name)
        elif not any(g.gpus > 0 and fits(g.kind, service.gpu_memory_mb)
                     and service.host_memory_mb <= g.host_memory_mb for g in good_groups):
            problems.append(f"service {service.name} fits no group ({service.gpu_memory_mb} MB per GPU, "
                            f"{service.host_memory_mb} MB of host memory)")
            unplaced.append(service.name)
        else:
            good.append(service)
    measured = speeds or {}

    def speed_of(s: ServiceLoad, g: NodeGroup) -> float:
        figure = measured.get((s.name, g.name))
        return figure if figure is not None and _positive(figure) else speed(g.kind, base, s.bound)

    matrix = np.array([[speed_of(s, g) if g.gpus > 0 and fits(g.kind, s.gpu_memory_mb)
                        and s.host_memory_mb <= g.host_memory_mb else 0.0 for g in good_groups] for s in good],
                      dtype=float).reshape(len(good), len(good_groups))
    return _Instance(services=tuple(s.name for s in good), groups=tuple(g.name for g in good_groups),
                     load=np.array([s.load for s in good], dtype=float),
                     host=np.array([s.host_memory_mb for s in good], dtype=float), speed=matrix,
                     gpus=np.array([g.gpus for g in good_groups], dtype=float),
                     host_room=np.array([g.host_memory_mb for g in good_groups], dtype=float),
                     unplaced=tuple(unplaced)), problems


def _positive(*figures: float) -> bool:
    return all(math.isfinite(f) and f > 0 for f in figures)


def _non_negative(*figures: float) -> bool:
    return all(math.isfinite(f) and f >= 0 for f in figures)


def _throughput(instance: _Instance, x: NDArray[np.bool_], a: Matrix) -> float:
    """``t``: the least factor by which a placed service with load is served (its served rate over its load); a
    service left without a variant is reported unplaced instead of making ``t`` 0."""
    loaded = (instance.load > 0) & x.any(axis=1)
    if not loaded.any():
        return math.inf
    served = (a * instance.speed).sum(axis=1)
    return float((served[loaded] / instance.load[loaded]).min())


def _t_max(instance: _Instance) -> float:
    """An upper bound on ``t``: each service alone on every GPU it fits."""
    loaded = instance.load > 0
    alone = (instance.speed * instance.gpus).sum(axis=1)
    return float((alone[loaded] / instance.load[loaded]).min()) if loaded.any() else 0.0


@dataclass(frozen=True)
class _Model:
    """The ILP of the module's docstring as arrays: columns ``a`` (one per pair), then ``x``, then ``t'``."""

    pairs: NDArray[np.intp]  # (service, group) rows of the pairs a service fits
    cost: Matrix
    constraints: LinearConstraint
    high: Matrix  # the columns' upper bounds (lower: 0)

    @property
    def a_at(self) -> NDArray[np.intp]:
        return np.arange(len(self.pairs))

    @property
    def x_at(self) -> NDArray[np.intp]:
        return len(self.pairs) + np.arange(len(self.pairs))

    def variants(self, instance: _Instance, solution: Matrix, x: Matrix) -> tuple[NDArray[np.bool_], Matrix]:
        """The variants (``x`` > 1/2) and their shares, as (service, group) matrices."""
        s_of, g_of = self.pairs[:, 0], self.pairs[:, 1]
        variants = np.zeros_like(instance.speed, dtype=bool)
        shares = np.zeros_like(instance.speed)
        variants[s_of, g_of] = x > 0.5
        shares[s_of, g_of] = np.clip(solution[self.a_at], 0.0, instance.gpus[g_of])
        return _pruned(instance, variants, shares), np.where(variants, shares, 0.0)


def _model(instance: _Instance, scale: float, current: Mapping[str, Iterable[str]],
           t_high: float | None = None) -> _Model:
    """The ILP with ``t = scale * t'``; the variants in ``current`` cost half the tie-break. ``t_high``, a bound on
    the optimal ``t``, tightens ``a[s,g] <= gpus[g] x[s,g]`` to ``a[s,g] <= min(gpus[g], t_high load[s] / speed[s,g])
    x[s,g]`` (serving a service more than ``t`` times its load never helps), which makes the relaxation's ``x`` close
    to the share of a service's load each group serves, so that host memory binds in it too."""
    pairs = np.argwhere(instance.allowed)
    n = len(pairs)
    s_of, g_of = pairs[:, 0], pairs[:, 1]
    most = instance.gpus[g_of]
    if t_high is not None:
        most = np.minimum(most, t_high * instance.load[s_of] / instance.speed[s_of, g_of])
    a_at, x_at, t_at = np.arange(n), n + np.arange(n), 2 * n
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def row(entries: Iterable[tuple[int, float]], low: float, high: float) -> None:
        for col, value in entries:
            rows.append(len(lower))
            cols.append(col)
            values.append(value)
        lower.append(low)
        upper.append(high)

    for s in range(len(instance.services)):
        mine = np.flatnonzero(s_of == s)
        if instance.load[s] > 0:  # served >= t * load
            row([(int(a_at[p]), float(instance.speed[s, g_of[p]])) for p in mine]
                + [(t_at, -scale * float(instance.load[s]))], 0.0, math.inf)
        row([(int(x_at[p]), 1.0) for p in mine], 1.0, math.inf)
    for g in range(len(instance.groups)):
        mine = np.flatnonzero(g_of == g)
        row([(int(a_at[p]), 1.0) for p in mine], -math.inf, float(instance.gpus[g]))
        row([(int(x_at[p]), float(instance.host[s_of[p]])) for p in mine], -math.inf, float(instance.host_room[g]))
    for p in range(n):
        row([(int(a_at[p]), 1.0), (int(x_at[p]), -float(most[p]))], -math.inf, 0.0)
    now = {(name, group) for name, groups in current.items() for group in groups}
    penalty = TIE_BREAK / max(n, 1)
    cost = np.zeros(2 * n + 1)
    cost[x_at] = [penalty / 2 if (instance.services[s], instance.groups[g]) in now else penalty for s, g in pairs]
    cost[t_at] = -1.0
    matrix = coo_array((values, (rows, cols)), shape=(len(lower), 2 * n + 1)).tocsr()
    return _Model(pairs=pairs, cost=cost, constraints=LinearConstraint(matrix, lower, upper),
                  high=np.concatenate([most, np.ones(n), [(t_high or _t_max(instance)) / scale]]))


def _t_high(instance: _Instance) -> float | None:
    """A bound on the ILP's ``t``: its relaxation's, solved again with each bound found while that tightens it by
    1%; None without load, or if an LP fails."""
    high = _t_max(instance)
    if not high:
        return None
    for _ in range(4):
        model = _model(instance, high, {}, high)
        try:
            result = milp(model.cost, bounds=Bounds(np.zeros_like(model.high), model.high),
                          constraints=model.constraints)
        except Exception as error:  # noqa: BLE001 - without the bound the ILP and the greedy still answer
            log.warning("GPU placement: the relaxation failed (%r)", error)
            return None
        if result.x is None:
            return None
        tighter = float(result.x[-1]) * high
        if tighter > 0.99 * high:
            return tighter
        high = tighter
    return high


def _ilp(instance: _Instance, scale: float, t_high: float | None, time_limit_s: float,
         current: Mapping[str, Iterable[str]]) -> tuple[NDArray[np.bool_], Matrix, bool] | str:
    """The ILP's (variants, shares, proven optimal), or why there is none."""
    model = _model(instance, scale if 0 < scale < math.inf else t_high or 1.0, current, t_high)
    n = len(model.pairs)
    try:
        result = milp(model.cost, integrality=np.concatenate([np.zeros(n), np.ones(n), [0]]),
                      bounds=Bounds(np.zeros_like(model.high), model.high), constraints=model.constraints,
                      options={"time_limit": max(time_limit_s, 0.0), "mip_rel_gap": TIE_BREAK / 10})
    except Exception as error:  # noqa: BLE001 - a solver failure must fall back, never reach the manager
        return f"the ILP solver failed: {error!r}"
    if result.x is None:
        why = {1: f"found no solution within its time limit of {time_limit_s} s",
               2: "is infeasible: host memory cannot hold a copy of every service"}.get(result.status, result.message)
        return f"the ILP {why}"
    x, a = model.variants(instance, result.x, result.x[model.x_at])
    return x, a, result.status == 0


def _relaxation(instance: _Instance, t_high: float | None) -> _Model:
    """The ILP the greedy dives through and checks its moves on (scaled by ``t_high``, without ``current``)."""
    return _model(instance, t_high or 1.0, {}, t_high)


def _greedy(instance: _Instance, model: _Model, t_high: float | None) -> tuple[NDArray[np.bool_], Matrix]:
    """The better of two dives through the LP relaxation (``_dive``: fixing the variant with the most host memory at
    stake, or first trying each group of a large copy), each improved by LP-checked relocation (``_relocated``).
    Neither is better on every instance (``loadtest/bench_placement.py``)."""
    answers: list[tuple[NDArray[np.bool_], Matrix]] = []
    for look_ahead in (False, True):
        answers.append(_relocated(instance, model, *_dive(instance, model, look_ahead), t_high,
                                  RELOCATION_LPS // 2))
        if _optimal(instance, *answers[-1], t_high):
            break
    return max(answers, key=lambda answer: _throughput(instance, *answer))


def _optimal(instance: _Instance, x: NDArray[np.bool_], a: Matrix, t_high: float | None) -> bool:
    """Whether ``t`` reaches the relaxation's bound: nothing can do better."""
    return t_high is not None and _throughput(instance, x, a) >= t_high * (1 - 1e-6)


def _dive(instance: _Instance, model: _Model, look_ahead: bool,
          bounds: tuple[Matrix, Matrix] | None = None) -> tuple[NDArray[np.bool_], Matrix]:
    """A dive through the ILP's LP relaxation, completed by list scheduling where it runs into host memory.

    The dive solves the relaxation (``x`` in [0, 1]; with ``t_high``, ``x`` is about the share of a service's load
    a group serves), fixes to 1 the free ``x`` with the most host memory at stake (``x * host``: big copies first, as
    in packing), and solves again; a fix that makes the relaxation infeasible becomes a 0. When no free ``x`` is above
    0 the fixed ones are the variants, with the last LP's shares: about one LP per variant. A dive that ends
    infeasible keeps what it fixed, and ``_round`` gives each service still without a variant
    one on its fastest group with room; the shares are then an LP's over those variants, or without one, each
    group's time in proportion to the GPU time its services need there. With ``look_ahead``, a large copy's group is
    chosen by trying each (``_look_ahead``). ``bounds`` (the columns' lower and upper, changed in place) start it with
    some variants fixed (``_exchange``)."""
    x_at, s_of, g_of = model.x_at, model.pairs[:, 0], model.pairs[:, 1]
    low, high = bounds or (np.zeros_like(model.high), model.high.copy())
    last: int | None = None
    for _ in range(2 * len(model.pairs) + 1):
        solution = _solve(model, low, high)
        if solution is None and last is not None:  # that fix was one too many: the variant stays out
            low[last], high[last], last = 0.0, 0.0, None
            continue
        if solution is None:
            break
        free = np.flatnonzero((low[x_at] < 1) & (high[x_at] > 0) & (solution[x_at] > 1e-9))
        if not len(free):
            return model.variants(instance, solution, low[x_at])
        last = int(x_at[free[np.argmax(solution[x_at][free] * instance.host[s_of[free]])]])
        if look_ahead:
            last = _look_ahead(instance, model, low, high, last)
        low[last] = 1.0
    fixed = np.zeros_like(instance.allowed)
    fixed[s_of, g_of] = low[x_at] > 0.5
    x = _round(instance, instance.speed, fixed, np.zeros_like(fixed), instance.speed)
    low[x_at] = high[x_at] = x[s_of, g_of]
    solution = _solve(model, low, high)
    if solution is not None:
        return model.variants(instance, solution, low[x_at])
    return x, _proportional(instance, x, np.divide(instance.load[:, None], instance.speed,
                                                   out=np.zeros_like(instance.speed), where=x))


def _look_ahead(instance: _Instance, model: _Model, low: Matrix, high: Matrix, column: int) -> int:
    """The ``x`` column to fix next instead of ``column`` when its service's host copy is large
    (``LOOK_AHEAD_SHARE`` of the group's host memory): of that service's free variants, the one whose fix leaves
    the relaxation the largest ``t`` (one LP each). A large copy on the fastest group may keep every other service
    off it; the relaxation after the fix sees that, the relaxation before it does not."""
    p = column - len(model.pairs)
    s, g = model.pairs[p]
    if instance.host[s] < LOOK_AHEAD_SHARE * instance.host_room[g]:
        return column
    best, best_t = column, -math.inf
    for q in np.flatnonzero((model.pairs[:, 0] == s) & (high[model.x_at] > 0) & (low[model.x_at] < 1)):
        trial = low.copy()
        trial[model.x_at[q]] = 1.0
        solution = _solve(model, trial, high)
        if solution is not None and solution[-1] > best_t:
            best, best_t = int(model.x_at[q]), float(solution[-1])
    return best


def _relocated(instance: _Instance, model: _Model, x: NDArray[np.bool_], a: Matrix, t_high: float | None,
               budget: int = RELOCATION_LPS) -> tuple[NDArray[np.bool_], Matrix]:
    """The greedy's variants improved by LP-checked relocation (a local search, first improvement). A move puts a
    variant of service ``s`` on group ``g`` (``_move``): added beside its others, or moved there from them; the
    variants on ``g`` that leave too little host memory for it are dropped, those of services with other variants
    first, and a service left without one gets one on its fastest group with room (``_round``). Tried in turn: an
    added variant for each of the ``RELOCATION_ADDERS`` least served services, then a moved one for every service,
    largest host copy first; each on its fastest groups first. Only when none of these improves, up to
    ``RELOCATION_EXCHANGES`` exchanges (``_exchange``) of two copies that cannot share a node, the largest first. A
    move is kept if the LP over the new variants serves every load by a larger ``t``. The search stops at the
    relaxation's bound, when no move improves, or after ``budget`` LPs (the exchanges' dives aside)."""
    best_t = _throughput(instance, x, a)
    spent = exchanges = 0

    def served_by(candidate: NDArray[np.bool_]) -> tuple[float, Matrix] | None:
        nonlocal spent
        spent += 1
        low, high = np.zeros_like(model.high), model.high.copy()
        low[model.x_at] = high[model.x_at] = candidate[model.pairs[:, 0], model.pairs[:, 1]]
        solution = _solve(model, low, high)
        if solution is None:
            return None
        shares = np.zeros_like(instance.speed)
        shares[model.pairs[:, 0], model.pairs[:, 1]] = solution[model.a_at]
        shares = np.where(candidate, shares, 0.0)
        return _throughput(instance, candidate, shares), shares

    def first_improvement() -> tuple[NDArray[np.bool_], float, Matrix] | None:
        nonlocal exchanges
        served = (a * instance.speed).sum(axis=1) / np.where(instance.load > 0, instance.load, math.inf)
        adding = [(int(s), False) for s in np.argsort(served, kind="stable")[:RELOCATION_ADDERS]]
        largest = [int(s) for s in np.argsort(-instance.host, kind="stable")]
        for s, move in adding + [(s, True) for s in largest]:
            for g in np.argsort(-instance.speed[s], kind="stable"):
                if spent >= budget:
                    return None
                if x[s, g] or not instance.allowed[s, g]:
                    continue
                candidate = _move(instance, x, a, s, g, move)
                answer = served_by(candidate) if candidate is not None else None
                if candidate is not None and answer is not None and answer[0] > best_t * (1 + 1e-6):
                    return candidate, *answer
        for i, s in enumerate(largest):
            for u in largest[i + 1:]:
                for g, h in itertools.product(np.flatnonzero(x[s] & ~x[u]), np.flatnonzero(x[u] & ~x[s])):
                    if exchanges >= RELOCATION_EXCHANGES:
                        return None
                    if (instance.host[s] + instance.host[u] <= max(instance.host_room[g], instance.host_room[h])
                            or not (instance.allowed[s, h] and instance.allowed[u, g])):
                        continue
                    exchanges += 1
                    traded, shares = _exchange(instance, model, s, int(g), u, int(h))
                    t = _throughput(instance, traded, shares)
                    if t > best_t * (1 + 1e-6):
                        return traded, t, shares
        return None

    while math.isfinite(best_t) and not _optimal(instance, x, a, t_high):
        found = first_improvement()
        if found is None:
            break
        x, best_t, a = found
    return x, a


def _exchange(instance: _Instance, model: _Model, s: int, g: int, u: int,
              h: int) -> tuple[NDArray[np.bool_], Matrix]:
    """A dive (``_dive``) with ``s``'s variant on ``h`` instead of ``g`` and ``u``'s on ``g`` instead of ``h``
    (``_relocated``). The trade displaces other copies on both groups, and where they go decides whether it pays:
    ``_move``'s re-homing (each to its fastest group with room, one at a time) can leave the right trade worse than
    no trade, where the dive re-places them with the LP."""
    column = np.zeros(instance.speed.shape, dtype=np.intp)
    column[model.pairs[:, 0], model.pairs[:, 1]] = model.x_at
    low, high = np.zeros_like(model.high), model.high.copy()
    low[column[s, h]] = low[column[u, g]] = 1.0
    high[column[s, g]] = high[column[u, h]] = 0.0
    return _dive(instance, model, look_ahead=False, bounds=(low, high))


def _move(instance: _Instance, x: NDArray[np.bool_], a: Matrix, s: int, g: int,
          moving: bool) -> NDArray[np.bool_] | None:
    """``x`` with a variant of ``s`` on ``g`` (``_relocated``), beside its others or, ``moving``, instead of them;
    None if host memory on ``g`` cannot be made, or a service is left with no group to go to."""
    candidate = x.copy()
    if moving:
        if x[s].sum() == 0:
            return None
        candidate[s] = False
    candidate[s, g] = True
    used = float(instance.host[candidate[:, g]].sum())

    def loss(t: int) -> tuple[bool, float]:  # dropping t's variant on g: whether t keeps one, how much it served
        return bool(candidate[t].sum() == 1), float(a[t, g] * instance.speed[t, g] / max(instance.load[t], 1e-12))

    others = sorted((int(t) for t in np.flatnonzero(candidate[:, g]) if t != s), key=loss)
    while used > instance.host_room[g] and others:
        dropped = others.pop(0)
        candidate[dropped, g] = False
        used -= instance.host[dropped]
    if used > instance.host_room[g]:
        return None
    homeless = ~candidate.any(axis=1)
    if homeless.any():
        candidate = _round(instance, instance.speed, candidate, np.zeros_like(candidate), instance.speed)
        if not candidate.any(axis=1).all():
            return None
    return candidate


def _solve(model: _Model, low: Matrix, high: Matrix) -> Matrix | None:
    """The relaxation within these column bounds (an LP, HiGHS), or None if infeasible or the solver fails."""
    try:
        return milp(model.cost, bounds=Bounds(low, high), constraints=model.constraints).x
    except Exception as error:  # noqa: BLE001 - the greedy is the fallback: it must answer without the solver
        log.warning("GPU placement: the greedy's LP failed (%r)", error)
        return None


def _round(instance: _Instance, rank: Matrix, start: NDArray[np.bool_], extra: NDArray[np.bool_],
           then: Matrix) -> NDArray[np.bool_]:
    """Variants under host memory, from ``start``: one for each service without one, in decreasing load, on its
    best-``rank``ed group (ties: most room left) among those that leave room for one copy of each service after it;
    then the ``extra`` pairs in decreasing ``then`` while room lasts. A service with no room anywhere gets none."""
    x = start.copy()
    room = instance.host_room - (x * instance.host[:, None]).sum(axis=0)
    order = np.array([s for s in np.argsort(-instance.load, kind="stable") if not x[s].any()], dtype=int)
    for i, s in enumerate(order):
        options = np.flatnonzero(instance.allowed[s] & (room >= instance.host[s]))
        leaving = [g for g in options if _packs(instance, order[i + 1:],
                                                np.where(np.arange(room.size) == g, room - instance.host[s], room))]
        options = np.array(leaving or options, dtype=int)
        if len(options):
            g = options[np.lexsort((-room[options], -rank[s, options]))[0]]
            x[s, g] = True
            room[g] -= instance.host[s]
    for flat in np.argsort(-np.where(extra & ~x, then, -math.inf), axis=None, kind="stable"):
        s, g = np.unravel_index(flat, x.shape)
        if extra[s, g] and not x[s, g] and room[g] >= instance.host[s]:
            x[s, g] = True
            room[g] -= instance.host[s]
    return x


def _packs(instance: _Instance, services: NDArray[np.intp], room: Matrix) -> bool:
    """Whether one host copy of each of ``services`` fits in ``room``: largest first, each where most room is left
    (a heuristic: it may say no to a packing that exists)."""
    room = room.copy()
    for s in sorted(services, key=lambda s: -instance.host[s]):
        options = np.flatnonzero(instance.allowed[s] & (room >= instance.host[s]))
        if not len(options):
            return False
        room[options[np.argmax(room[options])]] -= instance.host[s]
    return True


def _proportional(instance: _Instance, x: NDArray[np.bool_], weight: Matrix) -> Matrix:
    """Each group's GPUs shared among its variants in proportion to ``weight``."""
    demand = np.where(x, weight, 0.0)
    totals = demand.sum(axis=0)
    return np.divide(demand * instance.gpus, totals, out=np.zeros_like(demand), where=totals > 0)


def _pruned(instance: _Instance, x: NDArray[np.bool_], a: Matrix) -> NDArray[np.bool_]:
    """``x`` less the variants without a share whose service has load and a share elsewhere: they only cost."""
    served = (x & (a > 1e-9)).any(axis=1) & (instance.load > 0)
    return x & ~((a <= 1e-9) & served[:, None])


def _placement(method: Method, instance: _Instance, x: NDArray[np.bool_], a: Matrix, started: float,
               fallback: str | None = None, optimal: bool = False) -> Placement:
    """The answer, with each group's time left over (max-min leaves what no bottleneck needs) shared among its
    variants in proportion to their shares: ``t`` cannot fall, and no GPU idles while a variant could use it."""
    a = np.where(x, a, 0.0)
    used = a.sum(axis=0)
    a = np.divide(a * instance.gpus, used, out=a, where=used > 0)
    shares = {name: {instance.groups[g]: float(a[s, g]) for g in np.flatnonzero(x[s])}
              for s, name in enumerate(instance.services) if x[s].any()}
    unplaced = instance.unplaced + tuple(name for name in instance.services if name not in shares)
    return Placement(method=method, shares=shares, objective=_throughput(instance, x, a),
                     solve_s=time.perf_counter() - started, fallback=fallback, unplaced=unplaced, optimal=optimal)
