"""The speed-up model's durations of many actions at many unit counts, in one numpy evaluation.

A pass with a cold cache (the first one, a queue of new actions) asks for every member's duration at every count its
DP table can give; one ``SpeedupFit.duration`` call per count made those a large part of the pass. Here every
element goes through the same IEEE operations in the same order as that call (elementwise float64, no
reassociation), so each duration is bit for bit the one it gives and the plans do not change.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from tangram.core.action import Elasticity
from tangram.sched.speedup import SpeedupFit, size_of


def durations_at(fits: Sequence[SpeedupFit], elasticities: Sequence[Elasticity],
                 counts: Sequence[tuple[int, ...]]) -> list[tuple[float, ...]]:
    """``fits[i].duration(elasticities[i], m)`` for every ``m`` of ``counts[i]``, as one tuple per action."""
    lengths = [len(asked) for asked in counts]
    owner = np.repeat(np.arange(len(counts)), lengths)
    m = np.fromiter(itertools.chain.from_iterable(counts), dtype=float, count=len(owner))
    per_action = np.array([(fit.serial_s, fit.scale, fit.per_worker_s, fit.harness_s, fit.trusted, size_of(elasticity))
                           for fit, elasticity in zip(fits, elasticities)], dtype=float).reshape(-1, 6).T
    serial, scale, per_worker, harness, trusted, size = (column[owner] for column in per_action)
    units = np.minimum(m, trusted)
    parallel = size / (_efficiencies(elasticities, owner, units) * units)
    # workers as many as units: ``per_worker * w / min(units, w)`` with w = units, in that order
    fixed = serial + np.where(m > 1, harness + per_worker * m / m, 0.0)
    times = (size * fixed + scale * parallel).tolist()
    out: list[tuple[float, ...]] = []
    start = 0
    for length in lengths:
        out.append(tuple(times[start:start + length]))
        start += length
    return out


def _efficiencies(elasticities: Sequence[Elasticity], owner: np.ndarray, units: np.ndarray) -> np.ndarray:
    """``elasticities[owner[j]].efficiency_at(units[j])`` for every ``j``: the same bisect and interpolation."""
    listed = [len(elasticity.efficiency) for elasticity in elasticities]
    width = max(listed, default=0)
    if width == 0:
        return np.ones_like(units)
    # each declaration's listed counts and efficiencies as a row, padded past its end with counts no units reach
    # (so a row's bisect counts only its own) and efficiency 1 (an empty declaration's)
    ends = np.cumsum(listed)
    slots = np.arange(int(ends[-1])) + np.repeat(np.arange(len(listed)) * width - (ends - listed), listed)
    points = np.full(len(listed) * width, np.inf)
    values = np.ones(len(listed) * width)
    points[slots] = [m for elasticity in elasticities for m in elasticity.counts]
    values[slots] = [e for elasticity in elasticities for _, e in elasticity.efficiency]
    i = np.zeros(len(units), dtype=np.intp)  # bisect_left, a column at a time
    for column in points.reshape(-1, width).T:
        i += column[owner] < units
    # a listed count, or outside the listed span: the nearest listed efficiency
    last = np.maximum(np.asarray(listed) - 1, 0)[owner]
    at = owner * width + np.minimum(i, last)
    efficiency = values[at]
    inside = np.flatnonzero((i > 0) & (i <= last) & (points[at] != units))
    hi, u = at[inside], units[inside]
    m0, e0, m1, e1 = points[hi - 1], values[hi - 1], points[hi], values[hi]
    efficiency[inside] = (e0 * m0 + (e1 * m1 - e0 * m0) * (u - m0) / (m1 - m0)) / u
    return efficiency
