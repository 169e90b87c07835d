"""Malleable elastic actions: cores that change while an action runs, and how a pool's spare cores are shared.

The paper fixes an action's units when it starts (moldable). Where a manager can resize a running allocation (the
CPU manager rewrites a sandbox's cpuset in ~0.01 ms), an elastic action is *malleable* between its minimum (the
floor, never taken away) and its worker count (cores past its workers are useless), or its maximum where its
workers follow its cores (the elastic pytest runner, ``Workers``). Every scheduling pass then

1. lends the cores running malleable actions hold above their floors to the queue: queued actions are placed at
   their minimum as if those cores were free, so a short tool call never waits behind a long test run's extra
   cores;
2. shares what is left of each pool among the malleable actions there, running and starting, by marginal-gain
   water-filling (``share``): each unit to the action whose speed-up it raises the most, which maximises the
   pool's summed speed-up for concave profiles (EQUI generalised to unequal curves). docs/SCHEDULING.md says why
   this and not a shortest-remaining-first tilt (heSRPT), which ``share(by_remaining=True)`` also offers. A run
   whose duration nothing tells yet shares with its gains ``deferred``: it takes only units nobody else gains from.

Progress is tracked as estimated single-unit work done (``done_s``), advanced at the declared speed-up whenever the
units change, so remaining work is known at every pass. The same code serves the service and the simulator.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: an action past its estimate is assumed to have this share of its estimated work left (it is late, not done)
OVERRUN_SHARE = 0.1
#: at most this many (time, units) points are kept per action for its record
HISTORY_POINTS = 64
#: gains that differ by less than this share are equal (float rounding of the same speed-up)
TIED_GAIN = 1e-9
#: an assumed profile's gains are scaled by this in the sharing: below any estimated action's gain, so a run whose
#: duration nothing tells yet takes only the units no estimated action gains from
ASSUMED_GAIN_SHARE = 1e-6


@dataclass(frozen=True, slots=True, eq=False)
class Profile:
    """An elastic action's estimated speed-up over its allowed unit counts: ``curve[k] = E(k)·k`` for k up to the
    largest count, and the per-unit gain of each step between allowed counts (made non-increasing by a running
    minimum, so a profile that is not quite concave cannot make the sharing skip a count)."""

    counts: tuple[int, ...]
    curve: np.ndarray
    gains: np.ndarray  # gains[u] = speed-up gained by the (u+1)-th unit above the floor

    def speedup(self, units: int) -> float:
        return float(self.curve[min(units, len(self.curve) - 1)])


def deferred(profile: Profile) -> Profile:
    """``profile`` as the sharing sees a run whose duration is not known yet (its signature's first run): the same
    counts, with gains too small to outbid any estimated action's. Idle units are the only ones it gains, so a first
    run tries more cores when nobody else wants them and gives them back when somebody does."""
    return Profile(profile.counts, profile.curve, profile.gains * ASSUMED_GAIN_SHARE)


def profile_of_curve(curve: np.ndarray, counts: tuple[int, ...]) -> Profile:
    """The profile over allowed ``counts`` of a speed-up curve (``curve[k]`` for k = 0..counts[-1], curve[0] = 0)."""
    steps = np.diff(np.asarray(counts))
    per_unit = np.diff(curve[list(counts)]) / steps if len(counts) > 1 else np.zeros(0)
    gains = np.minimum.accumulate(np.repeat(per_unit, steps)) if len(per_unit) else np.zeros(0)
    return Profile(counts, curve, gains)


@dataclass(slots=True)
class Malleable:
    """A running action's resizable key resource: its bounds, its units over time and its estimated progress."""

    resource: str
    pool: str
    floor: int
    workers: int  # the cap: started with this many workers, more cores would idle (unless ``follows``)
    units: int
    since: float  # when ``units`` last changed
    t1_s: float  # estimated work on one unit (the duration model's T1)
    profile: Profile  # its allowed counts up to ``workers`` and estimated speed-up
    done_s: float = 0.0  # estimated single-unit work done up to ``since``
    unit_seconds: float = 0.0  # units held x time, up to ``since``
    resizes: int = 0
    history: list[tuple[float, int]] = field(default_factory=list)
    follows: bool = False  # its workers follow its units (``Workers.follows``)
    assumed: bool = False  # nothing known of its duration: ``profile`` is the declaration's shape (``deferred``)

    def rate(self) -> float:
        return self.profile.speedup(min(self.units, self.workers))

    def work_done(self, now: float) -> float:
        """Single-unit work done by ``now``, at the estimated speed-up of the units held over time."""
        return self.done_s + max(0.0, now - self.since) * self.rate()

    def remaining_s(self, now: float) -> float:
        """Estimated single-unit work left at ``now``."""
        return max(self.t1_s - self.work_done(now), OVERRUN_SHARE * self.t1_s)

    def resize(self, units: int, now: float) -> None:
        elapsed = max(0.0, now - self.since)
        self.done_s += elapsed * self.rate()
        self.unit_seconds += elapsed * self.units
        self.units = units
        self.since = now
        self.resizes += 1
        if len(self.history) < HISTORY_POINTS:
            self.history.append((now, units))

    def unit_seconds_at(self, now: float) -> float:
        return self.unit_seconds + max(0.0, now - self.since) * self.units

    def summary(self, now: float) -> dict[str, Any]:
        """What the action's record shows: its bounds, resizes, unit-seconds and units over time."""
        return {"resource": self.resource, "floor": self.floor, "workers": self.workers,
                "workers_follow_units": self.follows, "assumed": self.assumed, "resizes": self.resizes,
                "unit_seconds": round(self.unit_seconds_at(now), 6),
                "history": [[round(t, 6), units] for t, units in self.history]}


def share(spare: int, profiles: Sequence[Profile], remaining: Callable[[int], float],
          by_remaining: bool = False) -> list[int]:
    """Units for each malleable action of a pool (its ``profiles``): its floor plus its part of ``spare``, by
    marginal-gain water-filling. ``remaining(i)``: the i-th action's remaining work on one unit, asked only where
    it decides (a pass shares among hundreds of actions and rarely needs it).

    Every unit above a floor has a gain: the speed-up it adds, ``s(k+1) - s(k)`` (per unit of a step between
    allowed counts), or with ``by_remaining`` the completion rate it adds, that divided by the action's remaining
    work (shorter work first, as heSRPT). Each action's gains do not increase, so the greedy that hands out one
    unit at a time to the largest gain is the same as taking the ``spare`` largest gains at once, which is what this
    does (vectorised); equal gains go to the least remaining work. Without ``by_remaining`` the result maximises
    the summed speed-up of the pool's malleable actions (their throughput). Units that speed nobody up stay
    unshared; an action whose share ends inside a step between allowed counts is rounded down to the count below,
    and those units stay unshared until the pool's spare units or its actions change (the scheduler re-shares a
    pool only then).
    """
    floors = [p.counts[0] for p in profiles]
    if spare <= 0 or not profiles:
        return floors
    width = max(len(p.gains) for p in profiles)
    if width == 0:
        return floors
    gains = np.full((len(profiles), width), -np.inf)
    for i, profile in enumerate(profiles):
        row = profile.gains
        gains[i, :len(row)] = row / remaining(i) if by_remaining else row
    flat = gains.ravel()
    positive = int(np.count_nonzero(flat > 0))
    if positive <= spare:
        chosen = np.flatnonzero(flat > 0)
    else:
        chosen = _largest(flat, spare, lambda entries: _per_entry(remaining, entries // width))
    extra = np.bincount(chosen // width, minlength=len(profiles))
    units = []
    for profile, floor, more in zip(profiles, floors, extra.tolist()):
        counts = profile.counts
        units.append(counts[bisect.bisect_right(counts, floor + more) - 1])
    return units


def _per_entry(remaining: Callable[[int], float], rows: np.ndarray) -> np.ndarray:
    """``remaining`` of each entry's action, asked once per action (a linear run ties at every one of its units)."""
    actions, back = np.unique(rows, return_inverse=True)
    return np.array([remaining(i) for i in actions.tolist()])[back]


def _largest(gains: np.ndarray, count: int, remaining: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Indices of the ``count`` largest ``gains``; among those equal at the cut, the least remaining work's first
    (``remaining`` of some indices; a stable sort keeps each action's units in order). Ties are common: a linear
    learned speed-up gives a long run's next core the gain of a short run's first, and for the same throughput the
    short one first ends sooner on the mean."""
    cut = np.partition(gains, gains.size - count)[gains.size - count]
    tolerance = TIED_GAIN * max(1.0, abs(float(cut)))
    above = np.flatnonzero(gains > cut + tolerance)
    tied = np.flatnonzero(np.abs(gains - cut) <= tolerance)
    if tied.size > count - above.size:  # the cut splits a tie
        tied = tied[np.argsort(remaining(tied), kind="stable")]
    return np.concatenate((above, tied[:count - above.size]))


@dataclass(frozen=True, slots=True)
class Workers:
    """What a malleable action starts with: ``count`` workers, the most units it can use. With ``follows`` its
    workers follow its units instead (the elastic pytest runner forks a worker for each core it is given and lets
    one go for each taken): ``count`` is then only the cap, and it runs, and is modelled, with as many workers as
    units."""

    count: int
    follows: bool = False


@dataclass(frozen=True, slots=True)
class WorkerCost:
    """What starting workers costs an action, in wall seconds: each worker, and running in parallel at all (a
    controller: one worker runs plain pytest). Learned per signature (``tangram.sched.speedup``) once a run of it had
    more workers than cores."""

    per_worker_s: float
    harness_s: float = 0.0


def workers_for(units: int, cap: int, duration_s: float, cost: WorkerCost, overhead: float) -> int:
    """How many workers (``pytest -n``) an action started on ``units`` cores gets: as many as keep the start-up of
    the workers beyond ``units`` (``cost``) within ``overhead`` of its expected duration there. More workers let it
    grow into cores that free up later; each costs start-up time and memory now. ``cap`` bounds it (the action's
    maximum, the node's size); ``overhead`` 0 gives ``units``."""
    if overhead <= 0:
        return units
    budget = overhead * duration_s - (cost.harness_s if units == 1 else 0.0)
    if budget <= 0:
        return units
    if cost.per_worker_s <= 0:
        return cap
    return max(units, min(cap, units + int(budget / cost.per_worker_s)))
