"""Speed-up learned online from completed runs, per (task, action signature): users need not know ``E(m)`` or T1.

An elastic action's execution time on ``m`` units of its key resource, with ``W`` workers started, is modelled as

    T(m, W) = s·(a + [W > 1]·(d + c·W / min(m, W))) + b·P(m),        a, b, c, d >= 0

where ``P(m) = t1 / (E(m)·m)`` is the duration the action *declares* (Eq. 1) and ``s`` its declared ``t1`` (an
undeclared ``t1`` counts as 1 s and an undeclared efficiency as 1, so ``P(m) = 1/m`` and ``s = 1``). ``a`` is serial
time the declaration misses; ``b`` scales the declared parallel work (1 when the declaration is right); ``c`` is
each worker's start-up CPU (xdist's workers each import and collect the whole suite), shared by the units the
workers can use; ``d`` the fixed cost of running in parallel at all (xdist's controller: one worker runs plain
``pytest``). This is the form of the simulator's execution model, which reproduces five real suites' times at
1-2 cores and 1-2 workers per core within 10% (docs/EVALUATION.md). ``a``, ``c`` and ``d`` are per second of
declared ``t1``: the actions of one signature may declare different sizes, and a worker's start-up grows with the
suite it collects (measured: 1.2-27% of the suite's work per worker). On a short suite ``c`` and ``d`` cost more
than the parallel part gains. A declaration is thus a prior the runs correct, not a truth: with no runs the model is
the declaration (``a = c = d = 0, b = 1``).

The fit is least squares on relative errors with non-negative coefficients (SciPy's NNLS), pulled toward the
declaration only as far as the runs leave a direction open: one run fixes the scale (so do runs at counts less
than a doubling apart, whose difference is within a run's noise; plain runs beside runs with more workers than
units there fix the workers' cost too), each count observed after it overrules the prior there, and what the runs
cannot yet tell apart (serial time, worker start-up, the fixed parallel cost) is read as the one that predicts the
most gain from more units, so that those get tried (optimism where it is unsure). Bad observations are kept out or
down-weighted: only succeeded actions are observed (a timed-out, OOM-killed, failed or cancelled run never is, nor
one killed by a signal), and a few rounds of reweighting (Cauchy weights on a run's relative residual against the
median of the runs at its units and workers) make a run that waited on a lock and took several times longer than
the other runs at its count count for almost nothing.

Exploration: predictions are trusted up to twice the largest unit count observed (or the declared efficiency's
largest count): beyond it the model promises no further gain, so the scheduler tries one doubling at a time and
only where its objective says the predicted gain is worth the units. A malleable action (issue 8) is observed at
its mean units (unit-seconds / seconds) with the workers it started, so the model is of speed per unit over time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from tangram.core.action import Elasticity

#: runs kept per (task, signature): the newest, so a suite that changes over training is followed
RUNS_KEPT = 32
#: the declaration's pull on the fit, in runs: enough to settle what the runs leave open, never to outweigh one
PRIOR_WEIGHT = 1e-6
#: predictions are trusted up to this many times the largest unit count observed
EXPLORE_FACTOR = 2.0
#: Cauchy scale of the relative residual: a run this much off its prediction counts half
ROBUST_SCALE = 0.25
ROBUST_ROUNDS = 4
#: the least share of the runs' median scale the fitted ``b`` keeps
MIN_SCALE_SHARE = 1e-3
#: how far apart (largest / smallest units) runs must be before serial time and start-up are told from parallel work
SPREAD_TO_SEPARATE = 2.0
#: how much harder the pull on each term than on the serial time ``a``: where runs at too few counts leave the terms
#: unresolved, the fit leans to the reading that promises the most from more units (per-worker cost least of all)
DOUBT = (1.0, 1.0, 10.0, 3.0)


def size_of(elasticity: Elasticity) -> float:
    """The size an action declares, its ``t1`` (1 s when it declares none)."""
    return 1.0 if elasticity.t1 is None else elasticity.t1


def declared(elasticity: Elasticity, units: float) -> float:
    """``P(m)``: the duration the action declares on ``units`` (t1 1 s and E 1 where it declares none)."""
    return size_of(elasticity) / (elasticity.efficiency_at(units) * units)


@dataclass(frozen=True, slots=True)
class Run:
    """One observed run: mean units held, workers started, ``P`` at those units, the seconds it took and the size
    it declared (``t1``, 1 when none)."""

    units: float
    workers: int
    basis: float
    seconds: float
    size: float = 1.0

    def to_json(self) -> list[float]:
        return [round(self.units, 6), self.workers, round(self.basis, 9), round(self.seconds, 6),
                round(self.size, 9)]

    @classmethod
    def from_json(cls, row: list[float]) -> Run:
        units, workers, basis, seconds, size = row
        return cls(float(units), int(workers), float(basis), float(seconds), float(size))


@dataclass(frozen=True, slots=True)
class SpeedupFit:
    """Fitted coefficients (``a``, ``c``, ``d`` per second of declared size) and how far out they are trusted
    (``trusted`` units; inf with no run yet)."""

    serial_s: float  # a
    scale: float  # b
    per_worker_s: float  # c
    harness_s: float  # d
    trusted: float

    def duration(self, elasticity: Elasticity, units: float, workers: int | None = None) -> float:
        """Expected seconds on ``units`` with ``workers`` started (``units`` when None): no gain promised past
        ``trusted`` units, while the workers still cost."""
        parallel = declared(elasticity, min(float(units), self.trusted))
        w = units if workers is None else workers
        fixed = self.serial_s + (self.harness_s + self.per_worker_s * w / min(units, w) if w > 1 else 0.0)
        return size_of(elasticity) * fixed + self.scale * parallel

    def curve(self, elasticity: Elasticity, top: int, workers: int | None = None) -> np.ndarray:
        """``duration`` at 1, 2, ..., ``top`` units in one vectorised step (the malleable sharing needs the whole
        curve of every action whose fit changed, at each pass)."""
        units = np.arange(1, top + 1, dtype=float)
        capped = np.minimum(units, self.trusted)
        efficiency = elasticity.efficiencies_at(capped)
        w = units if workers is None else np.full_like(units, float(workers))
        fixed = self.serial_s + np.where(w > 1, self.harness_s + self.per_worker_s * w / np.minimum(units, w), 0.0)
        return size_of(elasticity) * fixed + self.scale * size_of(elasticity) / (efficiency * capped)

    def widened(self, trusted: float) -> SpeedupFit:
        return SpeedupFit(self.serial_s, self.scale, self.per_worker_s, self.harness_s, trusted)


PRIOR = SpeedupFit(0.0, 1.0, 0.0, 0.0, math.inf)


class Speedup:
    """The runs of one (task, signature) and their fit, refitted when a run is added."""

    __slots__ = ("_fit", "_widened", "runs")

    def __init__(self, runs: Iterable[Run] = ()) -> None:
        self.runs: deque[Run] = deque(runs, maxlen=RUNS_KEPT)
        self._fit: SpeedupFit | None = None
        self._widened: dict[int, SpeedupFit] = {}

    def add(self, run: Run) -> None:
        self.runs.append(run)
        self._fit = None
        self._widened.clear()

    def fit(self, elasticity: Elasticity) -> SpeedupFit:
        """The fit for an action declaring ``elasticity`` (its efficiency's span widens what is trusted)."""
        fit = self._fit
        if fit is None:
            fit = self._fit = fit_runs(tuple(self.runs))
        listed = elasticity.counts[-1] if elasticity.counts else 0
        if listed <= fit.trusted:
            return fit
        widened = self._widened.get(listed)
        if widened is None:
            widened = self._widened[listed] = fit.widened(float(listed))
        return widened


def fit_runs(runs: tuple[Run, ...]) -> SpeedupFit:
    """Robust non-negative least squares of ``seconds ~ size·(a + [W > 1]·(d + c·W / min(units, W))) + b·basis``
    on relative errors, pulled (``PRIOR_WEIGHT``, ``DOUBT``) toward ``a = c = d = 0`` and ``b`` = the runs' median of
    ``seconds / basis``, each term measured as its share of a typical run."""
    if not runs:
        return PRIOR
    seconds = np.array([r.seconds for r in runs])
    basis = np.array([r.basis for r in runs])
    workers = np.array([float(r.workers) for r in runs])
    units = np.array([r.units for r in runs])
    size = np.array([r.size for r in runs])
    parallel = (workers > 1).astype(float)
    features = np.column_stack([size, basis, size * parallel * workers / np.minimum(units, workers), size * parallel])
    scale = float(np.median(seconds / basis))
    prior = np.array([0.0, scale, 0.0, 0.0])
    # a coefficient's pull is on its share of a typical run (a term no run has used counts as used once)
    share = np.maximum(np.mean(features, axis=0), float(np.mean(size))) / float(np.mean(seconds))
    share[1] = 1.0 / scale
    pull = math.sqrt(PRIOR_WEIGHT) * np.asarray(DOUBT) * share
    design = features / seconds[:, None]
    # runs at one unit count cannot tell serial time or start-up from parallel work (whatever sizes the actions
    # declare), nor can runs at counts close together (29-32 cores change the parallel part by a tenth, less than
    # one run's noise: found reading a whole suite as serial and starting the next runs on one core): until counts
    # a doubling apart are seen, only the scale is fitted, and the workers' cost with it once plain runs and runs
    # with more workers than units were both seen (plain pytest on one core and two workers squeezed onto it tell
    # that cost apart, not serial time: found as a squeezed run read as a larger suite)
    if units.max() >= SPREAD_TO_SEPARATE * units.min():
        free = np.arange(4)
    elif np.any(workers == 1) and np.any(workers > units + 0.5):
        free = np.arange(1, 4)
    else:
        free = np.arange(1, 2)
    # a run is an outlier against the other runs at its (units, workers), never a whole count against the rest: a
    # count the model cannot fit says the model is wrong, not the runs
    _, group = np.unique(np.round(units * 10.0) * float(1 << 20) + workers, return_inverse=True)
    group = group.ravel()
    weights = np.ones_like(seconds)
    coefficients = prior
    for _ in range(ROBUST_ROUNDS):
        fitted, _ = nnls(np.vstack([(design * weights[:, None])[:, free], np.diag(pull[free])]),
                         np.concatenate([weights, pull[free] * prior[free]]))
        coefficients = np.zeros(4)
        coefficients[free] = fitted
        residual = design @ coefficients - 1.0
        typical = _group_medians(residual, group)
        weights = np.sqrt(1.0 / (1.0 + ((residual - typical[group]) / ROBUST_SCALE) ** 2))
    a, b, c, d = (float(x) for x in coefficients)
    # the declared parallel work never vanishes: a duration of zero on one unit would make every speed-up undefined
    b = max(b, MIN_SCALE_SHARE * scale)
    return SpeedupFit(a, b, c, d, EXPLORE_FACTOR * max(r.units for r in runs))


def _group_medians(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """The median of ``values`` in each group (``group`` numbers them 0..n-1), in one sort: the fit runs at every
    completion, and a median per group in a Python loop was most of its time."""
    ordered = values[np.lexsort((values, group))]
    counts = np.bincount(group)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (ordered[starts + (counts - 1) // 2] + ordered[starts + counts // 2]) / 2.0
