"""The placement's ILP (the docstring of ``managers/gpu/placement.py``) as arrays for HiGHS: the model, its LP
relaxation and the bound on ``t`` that gives, and the ILP solved under a time limit."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from managers.gpu.placement_problem import Matrix, ProblemInstance, pruned, t_max

log = logging.getLogger("managers.gpu.placement")  # one logger for the placement, whichever module answers

#: the share of ``t`` the ILP may give up, over all variants together, to keep fewer of them
TIE_BREAK = 1e-3


@dataclass(frozen=True)
class IlpModel:
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

    def variants(self, instance: ProblemInstance, solution: Matrix, x: Matrix) -> tuple[NDArray[np.bool_], Matrix]:
        """The variants (``x`` > 1/2) and their shares, as (service, group) matrices."""
        s_of, g_of = self.pairs[:, 0], self.pairs[:, 1]
        variants = np.zeros_like(instance.speed, dtype=bool)
        shares = np.zeros_like(instance.speed)
        variants[s_of, g_of] = x > 0.5
        shares[s_of, g_of] = np.clip(solution[self.a_at], 0.0, instance.gpus[g_of])
        return pruned(instance, variants, shares), np.where(variants, shares, 0.0)


def _model(instance: ProblemInstance, scale: float, current: Mapping[str, Iterable[str]],
           t_high: float | None = None) -> IlpModel:
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
    return IlpModel(pairs=pairs, cost=cost, constraints=LinearConstraint(matrix, lower, upper),
                  high=np.concatenate([most, np.ones(n), [(t_high or t_max(instance)) / scale]]))


def bound_on_t(instance: ProblemInstance) -> float | None:
    """A bound on the ILP's ``t``: its relaxation's, solved again with each bound found while that tightens it by
    1%; None without load, or if an LP fails."""
    high = t_max(instance)
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


def solve_ilp(instance: ProblemInstance, scale: float, t_high: float | None, time_limit_s: float,
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


def lp_relaxation(instance: ProblemInstance, t_high: float | None) -> IlpModel:
    """The ILP the greedy dives through and checks its moves on (scaled by ``t_high``, without ``current``)."""
    return _model(instance, t_high or 1.0, {}, t_high)


def solve_lp(model: IlpModel, low: Matrix, high: Matrix) -> Matrix | None:
    """The relaxation within these column bounds (an LP, HiGHS), or None if infeasible or the solver fails."""
    try:
        return milp(model.cost, bounds=Bounds(low, high), constraints=model.constraints).x
    except Exception as error:  # noqa: BLE001 - the greedy is the fallback: it must answer without the solver
        log.warning("GPU placement: the greedy's LP failed (%r)", error)
        return None
