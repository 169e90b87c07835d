"""The placement's greedy (``managers/gpu/placement.py``), its answer when the ILP gives none: dives through the
ILP's LP relaxation, improved by an LP-checked local search of variant moves; and the rounding of variants under
host memory that the type-blind baseline shares."""

from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.typing import NDArray

from managers.gpu.placement_model import IlpModel, solve_lp
from managers.gpu.placement_problem import Matrix, ProblemInstance, proportional, throughput

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


def greedy(instance: ProblemInstance, model: IlpModel, t_high: float | None) -> tuple[NDArray[np.bool_], Matrix]:
    """The better of two dives through the LP relaxation (``dive``: fixing the variant with the most host memory at
    stake, or first trying each group of a large copy), each improved by LP-checked relocation (``_relocated``).
    Neither is better on every instance (``loadtest/bench_placement.py``)."""
    answers: list[tuple[NDArray[np.bool_], Matrix]] = []
    for look_ahead in (False, True):
        answers.append(_relocated(instance, model, *dive(instance, model, look_ahead), t_high,
                                  RELOCATION_LPS // 2))
        if _optimal(instance, *answers[-1], t_high):
            break
    return max(answers, key=lambda answer: throughput(instance, *answer))


def _optimal(instance: ProblemInstance, x: NDArray[np.bool_], a: Matrix, t_high: float | None) -> bool:
    """Whether ``t`` reaches the relaxation's bound: nothing can do better."""
    return t_high is not None and throughput(instance, x, a) >= t_high * (1 - 1e-6)


def dive(instance: ProblemInstance, model: IlpModel, look_ahead: bool,
          bounds: tuple[Matrix, Matrix] | None = None) -> tuple[NDArray[np.bool_], Matrix]:
    """A dive through the ILP's LP relaxation, completed by list scheduling where it runs into host memory.

    The dive solves the relaxation (``x`` in [0, 1]; with ``t_high``, ``x`` is about the share of a service's load
    a group serves), fixes to 1 the free ``x`` with the most host memory at stake (``x * host``: big copies first, as
    in packing), and solves again; a fix that makes the relaxation infeasible becomes a 0. When no free ``x`` is above
    0 the fixed ones are the variants, with the last LP's shares: about one LP per variant. A dive that ends
    infeasible keeps what it fixed, and ``round_variants`` gives each service still without a variant
    one on its fastest group with room; the shares are then an LP's over those variants, or without one, each
    group's time in proportion to the GPU time its services need there. With ``look_ahead``, a large copy's group is
    chosen by trying each (``_look_ahead``). ``bounds`` (the columns' lower and upper, changed in place) start it with
    some variants fixed (``_exchange``)."""
    x_at, s_of, g_of = model.x_at, model.pairs[:, 0], model.pairs[:, 1]
    low, high = bounds or (np.zeros_like(model.high), model.high.copy())
    last: int | None = None
    for _ in range(2 * len(model.pairs) + 1):
        solution = solve_lp(model, low, high)
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
    x = round_variants(instance, instance.speed, fixed, np.zeros_like(fixed), instance.speed)
    low[x_at] = high[x_at] = x[s_of, g_of]
    solution = solve_lp(model, low, high)
    if solution is not None:
        return model.variants(instance, solution, low[x_at])
    return x, proportional(instance, x, np.divide(instance.load[:, None], instance.speed,
                                                   out=np.zeros_like(instance.speed), where=x))


def _look_ahead(instance: ProblemInstance, model: IlpModel, low: Matrix, high: Matrix, column: int) -> int:
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
        solution = solve_lp(model, trial, high)
        if solution is not None and solution[-1] > best_t:
            best, best_t = int(model.x_at[q]), float(solution[-1])
    return best


def _relocated(instance: ProblemInstance, model: IlpModel, x: NDArray[np.bool_], a: Matrix, t_high: float | None,
               budget: int = RELOCATION_LPS) -> tuple[NDArray[np.bool_], Matrix]:
    """The greedy's variants improved by LP-checked relocation (a local search, first improvement). A move puts a
    variant of service ``s`` on group ``g`` (``_move``): added beside its others, or moved there from them; the
    variants on ``g`` that leave too little host memory for it are dropped, those of services with other variants
    first, and a service left without one gets one on its fastest group with room (``round_variants``). Tried in
    turn: an added variant for each of the ``RELOCATION_ADDERS`` least served services, then a moved one for every
    service, largest host copy first; each on its fastest groups first. Only when none of these improves, up to
    ``RELOCATION_EXCHANGES`` exchanges (``_exchange``) of two copies that cannot share a node, the largest first. A
    move is kept if the LP over the new variants serves every load by a larger ``t``. The search stops at the
    relaxation's bound, when no move improves, or after ``budget`` LPs (the exchanges' dives aside)."""
    best_t = throughput(instance, x, a)
    spent = exchanges = 0

    def served_by(candidate: NDArray[np.bool_]) -> tuple[float, Matrix] | None:
        nonlocal spent
        spent += 1
        low, high = np.zeros_like(model.high), model.high.copy()
        low[model.x_at] = high[model.x_at] = candidate[model.pairs[:, 0], model.pairs[:, 1]]
        solution = solve_lp(model, low, high)
        if solution is None:
            return None
        shares = np.zeros_like(instance.speed)
        shares[model.pairs[:, 0], model.pairs[:, 1]] = solution[model.a_at]
        shares = np.where(candidate, shares, 0.0)
        return throughput(instance, candidate, shares), shares

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
                    t = throughput(instance, traded, shares)
                    if t > best_t * (1 + 1e-6):
                        return traded, t, shares
        return None

    while math.isfinite(best_t) and not _optimal(instance, x, a, t_high):
        found = first_improvement()
        if found is None:
            break
        x, best_t, a = found
    return x, a


def _exchange(instance: ProblemInstance, model: IlpModel, s: int, g: int, u: int,
              h: int) -> tuple[NDArray[np.bool_], Matrix]:
    """A dive (``dive``) with ``s``'s variant on ``h`` instead of ``g`` and ``u``'s on ``g`` instead of ``h``
    (``_relocated``). The trade displaces other copies on both groups, and where they go decides whether it pays:
    ``_move``'s re-homing (each to its fastest group with room, one at a time) can leave the right trade worse than
    no trade, where the dive re-places them with the LP."""
    column = np.zeros(instance.speed.shape, dtype=np.intp)
    column[model.pairs[:, 0], model.pairs[:, 1]] = model.x_at
    low, high = np.zeros_like(model.high), model.high.copy()
    low[column[s, h]] = low[column[u, g]] = 1.0
    high[column[s, g]] = high[column[u, h]] = 0.0
    return dive(instance, model, look_ahead=False, bounds=(low, high))


def _move(instance: ProblemInstance, x: NDArray[np.bool_], a: Matrix, s: int, g: int,
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
        candidate = round_variants(instance, instance.speed, candidate, np.zeros_like(candidate), instance.speed)
        if not candidate.any(axis=1).all():
            return None
    return candidate


def round_variants(instance: ProblemInstance, rank: Matrix, start: NDArray[np.bool_], extra: NDArray[np.bool_],
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


def _packs(instance: ProblemInstance, services: NDArray[np.intp], room: Matrix) -> bool:
    """Whether one host copy of each of ``services`` fits in ``room``: largest first, each where most room is left
    (a heuristic: it may say no to a packing that exists)."""
    room = room.copy()
    for s in sorted(services, key=lambda s: -instance.host[s]):
        options = np.flatnonzero(instance.allowed[s] & (room >= instance.host[s]))
        if not len(options):
            return False
        room[options[np.argmax(room[options])]] -= instance.host[s]
    return True
