"""Duration and speed-up learned from completed actions, per (task, action signature).

The scheduler needs, for an elastic action, its duration at each allowed unit count and its speed-up curve, and for
the rest an expected duration (the paper uses historical averages). Two things are learned:

- an EWMA of the observed duration normalised to one unit by the declared profile (``t1``): the expected duration
  of actions that are not elastic, and what ``GET /v1/profiles`` shows as T1;
- for elastic actions, a speed-up model fitted to their runs (``tangram.sched.speedup``):
  ``T(m, W) = s·(a + [W > 1]·(d + c·W/min(m, W))) + b·P(m)`` around the declared ``P(m)`` and size ``s``. It is
  what the scheduler uses once an action's signature has run elastically; before that the declaration alone (Eq. 1)
  with the declared ``t1`` or the EWMA's. An action with neither runs at its minimum, or, where its workers follow
  its units (the elastic pytest runner), malleable from its minimum into the units no estimated action gains from
  (``malleable.deferred``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tangram.core.action import Action, Elasticity
from tangram.core.malleable import Profile, WorkerCost, profile_of_curve
from tangram.sched.durations_at import durations_at
from tangram.sched.speedup import PRIOR, Run, Speedup, SpeedupFit, declared, size_of

#: durations kept per model, by (fit, declaration, counts): a queued action's are asked again at every pass
DURATIONS_KEPT = 65536
_TimesKey = tuple[SpeedupFit, Elasticity, tuple[int, ...]]


@dataclass(slots=True)
class DurationProfile:
    """The EWMA of an action signature's single-unit duration and how many runs it has seen."""

    t1: float
    samples: int


class DurationModel:
    def __init__(self, alpha: float = 0.2, default_s: float = 1.0) -> None:
        self.alpha = alpha
        self.default_s = default_s
        self.profiles: dict[tuple[str, str], DurationProfile] = {}
        self.speedups: dict[tuple[str, str], Speedup] = {}
        self.dirty: set[tuple[str, str]] = set()
        self._dirty_runs: set[tuple[str, str]] = set()
        #: the durations asked before (the same until the signature's fit changes), oldest first
        self._times: dict[_TimesKey, tuple[float, ...]] = {}

    def load(self, task: str, signature: str, t1: float, samples: int) -> None:
        self.profiles[(task, signature)] = DurationProfile(t1, samples)

    def load_runs(self, task: str, signature: str, runs: list[list[float]]) -> None:
        self.speedups[(task, signature)] = Speedup(Run.from_json(row) for row in runs)

    def fit(self, action: Action) -> SpeedupFit | None:
        """The speed-up model of an elastic action: learned from its signature's runs, else its declaration (with
        a declared ``t1``, or the T1 learned before its signature had runs); None when neither is known."""
        if action.elasticity is None or action.key_resource is None:
            return None
        learned = self.speedups.get((action.task, action.signature))
        if learned is not None and learned.runs:
            return learned.fit(action.elasticity)
        if action.elasticity.t1 is not None:
            return PRIOR
        profile = self.profiles.get((action.task, action.signature))
        return None if profile is None else SpeedupFit(0.0, profile.t1, 0.0, 0.0, PRIOR.trusted)

    def t1(self, action: Action, workers: int | None = None) -> float | None:
        """Expected duration on one unit (with ``workers`` started: a malleable action's work on one unit), from
        the speed-up model of an elastic action, else the declared or learned T1; None when none is known."""
        fit = self.fit(action)
        if fit is not None:
            return fit.duration(action.elasticity, 1, 1 if workers is None else workers)  # type: ignore[arg-type]
        if action.elasticity is not None and action.elasticity.t1 is not None:
            return action.elasticity.t1
        profile = self.profiles.get((action.task, action.signature))
        return None if profile is None else profile.t1

    def scalable(self, action: Action) -> bool:
        """Elastic along a key resource *and* with a known duration: only these enter DPArrange."""
        return self.fit(action) is not None

    def duration(self, action: Action, units: int | None = None, workers: int | None = None) -> float:
        """Expected execution time on ``units`` of the key resource (its minimum when None), ``workers`` started
        (as many as units when None)."""
        fit = self.fit(action)
        if fit is None:
            t1 = self.t1(action)
            return self.default_s if t1 is None else t1
        m = units if units is not None else action.demands[action.key_resource].min  # type: ignore[index]
        return fit.duration(action.elasticity, m, workers)  # type: ignore[arg-type]

    def durations(self, action: Action, counts: tuple[int, ...]) -> tuple[float, ...]:
        """``duration`` at each of ``counts`` (one model lookup for all: the DP asks for every allowed count). One
        action's, a call per count: for a few counts that costs less than ``durations_many``'s numpy steps."""
        times, key = self._known(action, counts)
        if key is None:
            return times
        fit, elasticity, _ = key
        return self._keep(key, tuple(fit.duration(elasticity, m) for m in counts))

    def durations_many(self, actions: Sequence[Action], counts: Sequence[tuple[int, ...]]) -> list[tuple[float, ...]]:
        """``durations`` of each action at its counts, those not asked before in one evaluation of the model for
        all: a new queue's DP tables ask for every member's counts, and a model call per action was most of it."""
        out: list[tuple[float, ...]] = []
        missing: list[tuple[int, _TimesKey]] = []
        for action, asked in zip(actions, counts):
            times, key = self._known(action, asked)
            if key is not None:
                missing.append((len(out), key))
            out.append(times)
        if missing:
            keys = [key for _, key in missing]
            evaluated = durations_at([k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys])
            for (index, key), times in zip(missing, evaluated):
                out[index] = self._keep(key, times)
        return out

    def _known(self, action: Action, counts: tuple[int, ...]) -> tuple[tuple[float, ...], _TimesKey | None]:
        """The durations at ``counts`` when they need no evaluation of the speed-up model (no fit, or asked before),
        and None; else () and the key to ``_keep`` them under once evaluated."""
        fit = self.fit(action)
        if fit is None:
            return (self.duration(action),) * len(counts), None
        elasticity: Elasticity = action.elasticity  # type: ignore[assignment]
        key = (fit, elasticity, counts)
        times = self._times.get(key)
        return (times, None) if times is not None else ((), key)

    def _keep(self, key: _TimesKey, times: tuple[float, ...]) -> tuple[float, ...]:
        """Remember ``times`` for ``key``, forgetting the oldest past ``DURATIONS_KEPT``."""
        self._times[key] = times
        if len(self._times) > DURATIONS_KEPT:
            del self._times[next(iter(self._times))]
        return times

    def worker_cost(self, action: Action, units: int) -> WorkerCost | None:
        """What one more worker on ``units`` (its start-up CPU shared by them) and running in parallel at all (a
        controller and the first worker) were seen to cost this action's signature; None until it has run with more
        than one worker and, for the per-worker part, with more workers than units (before that the model cannot
        tell the two apart, nor either from serial time)."""
        learned = self.speedups.get((action.task, action.signature))
        if learned is None or action.elasticity is None or not any(r.workers > r.units + 0.5 for r in learned.runs):
            return None
        fit = learned.fit(action.elasticity)
        size = size_of(action.elasticity)
        return WorkerCost(fit.per_worker_s * size / units, (fit.harness_s + fit.per_worker_s) * size)

    def profile(self, action: Action, counts: tuple[int, ...], workers: int | None = None) -> Profile:
        """The speed-up over ``counts`` the malleable sharing uses: ``T(1)/T(k)`` with ``workers`` started (as many
        as units when None: an action about to start). For an elastic action whose duration is not known yet (not
        ``scalable``) it is the declaration's shape, linear where it declares no curve: assumed, not estimated."""
        if action.elasticity is None:
            raise ValueError(f"action {action.id} is not elastic")
        return _learned_profile(self.fit(action) or PRIOR, action.elasticity, counts, workers)

    def observe(self, action: Action) -> None:
        """Fold a successful action's execution time into its profile, and an elastic one's run into its model.
        A command killed by a signal is no observation (it did not run its course)."""
        if action.execution_s is None:
            return
        if isinstance(action.result, dict) and action.result.get("signal"):
            return
        seconds = action.execution_s - (action.restore_s or 0.0)  # a restore depends on placement, not the action
        sample = seconds
        key = action.key_resource
        ran_elastic = key is not None and action.elasticity is not None and key in action.units
        if action.malleable is not None and action.started_at is not None:
            sample = action.malleable.work_done(action.started_at + seconds)  # its units changed as it ran
        elif ran_elastic:
            m = action.units[key]  # type: ignore[index]
            sample *= action.elasticity.efficiency_at(m) * m  # type: ignore[union-attr]
        ident = (action.task, action.signature)
        profile = self.profiles.get(ident)
        if profile is None:
            self.profiles[ident] = DurationProfile(sample, 1)
        else:
            profile.t1 += self.alpha * (sample - profile.t1)
            profile.samples += 1
        self.dirty.add(ident)
        if ran_elastic and seconds > 0:
            self._observe_run(ident, action, seconds)

    def _observe_run(self, ident: tuple[str, str], action: Action, seconds: float) -> None:
        held = action.malleable
        if held is not None and action.started_at is not None:
            units = held.unit_seconds_at(action.started_at + seconds) / seconds
            workers = max(1, round(units)) if held.follows else held.workers
        else:
            units = workers = action.units[action.key_resource]  # type: ignore[index]
        if units <= 0:
            return
        elasticity: Elasticity = action.elasticity  # type: ignore[assignment]
        run = Run(units, workers, declared(elasticity, units), seconds, size_of(elasticity))
        self.speedups.setdefault(ident, Speedup()).add(run)
        self._dirty_runs.add(ident)

    def take_dirty(self) -> list[tuple[str, str, float, int]]:
        """Profiles changed since the last call, for the store to persist."""
        rows = [(task, sig, self.profiles[(task, sig)].t1, self.profiles[(task, sig)].samples)
                for task, sig in self.dirty]
        self.dirty.clear()
        return rows

    def take_dirty_runs(self) -> list[tuple[str, str, list[list[float]]]]:
        """Speed-up models given a run since the last call: their runs, for the store to persist."""
        rows = [(task, sig, [run.to_json() for run in self.speedups[(task, sig)].runs])
                for task, sig in self._dirty_runs]
        self._dirty_runs.clear()
        return rows


@functools.lru_cache(maxsize=16384)
def _learned_profile(fit: SpeedupFit, elasticity: Elasticity, counts: tuple[int, ...],
                     workers: int | None) -> Profile:
    times = fit.curve(elasticity, counts[-1], workers)
    return profile_of_curve(np.concatenate([[0.0], times[0] / times]), counts)
