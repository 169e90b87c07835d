"""The action formulation of §4.1: vectorized demand, elasticity profile and lifecycle record."""

from __future__ import annotations

import bisect
import os
import random
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tangram.core.malleable import Malleable


class Kind(StrEnum):
    EXEC = "exec"
    REWARD = "reward"
    API = "api"
    LEASE = "lease"


class State(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def terminal(self) -> bool:
        return self not in _LIVE


#: the states an action may leave (a frozenset of their strings: read on every transition, so no enum lookups)
_LIVE = frozenset(("queued", "running"))


@dataclass(frozen=True, slots=True)
class Demand:
    """Allowed unit counts of one resource type, ascending: a fixed amount, a range or a discrete set."""

    choices: tuple[int, ...]

    @classmethod
    def fixed(cls, units: int) -> Demand:
        demand = _FIXED.get(units)
        if demand is None:
            demand = cls((units,))
            if units <= _FIXED_SHARED:
                _FIXED[units] = demand
        return demand

    @classmethod
    def range(cls, low: int, high: int) -> Demand:
        return cls(tuple(range(low, high + 1)))

    @property
    def min(self) -> int:
        return self.choices[0]

    @property
    def max(self) -> int:
        return self.choices[-1]

    @property
    def elastic(self) -> bool:
        return len(self.choices) > 1

    def up_to(self, limit: int) -> tuple[int, ...]:
        """The allowed counts not above ``limit``."""
        return self.choices[: bisect.bisect_right(self.choices, limit)]

    def to_json(self) -> Any:
        if len(self.choices) == 1:
            return self.min
        if self.choices == tuple(range(self.min, self.max + 1)):
            return {"min": self.min, "max": self.max}
        return {"choices": list(self.choices)}

    @classmethod
    def from_json(cls, value: Any) -> Demand:
        """The inverse of ``to_json``, for records the broker wrote itself (a client's demand is checked by the
        request types of ``tangram.parse`` instead)."""
        if isinstance(value, int):
            return cls.fixed(value)
        if "choices" in value:
            return cls(tuple(value["choices"]))
        return cls.range(value["min"], value["max"])


#: fixed demands of up to this many units are shared instances (immutable, and built for nearly every action)
_FIXED_SHARED = 1024
_FIXED: dict[int, Demand] = {}


@dataclass(frozen=True, slots=True)
class Elasticity:
    """How the key resource speeds the action up: ``getDur(m) = T1 / (E(m) * m)`` (Eq. 1), as the client declares it.

    ``efficiency`` lists E at some unit counts; in between, the speed-up ``E(m)·m`` is interpolated linearly
    (interpolating E itself bends an Amdahl curve listed at 1, 2, 4, ... 32 into bumps: a serial half gained more
    on 6 units than on 8), and counts outside the listed span take the nearest listed E; none listed reads as
    E = 1. ``t1`` may be omitted. Either way the broker learns the action's real curve from its runs
    (``tangram.sched.speedup``); the declaration is its prior.
    """

    resource: str
    efficiency: tuple[tuple[int, float], ...] = ()
    t1: float | None = None
    counts: tuple[int, ...] = field(init=False, repr=False, compare=False)  # listed counts, for bisect
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple(m for m, _ in self.efficiency))
        object.__setattr__(self, "_hash", hash((self.resource, self.efficiency, self.t1)))

    def __hash__(self) -> int:
        """Computed once: a queued action's declaration keys the duration cache at every pass."""
        return self._hash

    def __reduce__(self) -> tuple[type[Elasticity], tuple[str, tuple[tuple[int, float], ...], float | None]]:
        """Rebuilt from its fields in another process: a string's hash, and so ``_hash``, differs there."""
        return Elasticity, (self.resource, self.efficiency, self.t1)

    def efficiency_at(self, m: float) -> float:
        points = self.efficiency
        if not points:
            return 1.0
        i = bisect.bisect_left(self.counts, m)
        if i < len(points) and points[i][0] == m:
            return points[i][1]
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (m0, e0), (m1, e1) = points[i - 1], points[i]
        return (e0 * m0 + (e1 * m1 - e0 * m0) * (m - m0) / (m1 - m0)) / m

    def efficiencies_at(self, units: np.ndarray) -> np.ndarray:
        """``efficiency_at`` at every one of ``units`` in one numpy step (the malleable sharing reads whole
        curves at each pass)."""
        if not self.efficiency:
            return np.ones_like(units)
        counts = np.asarray(self.counts, dtype=float)
        listed = np.array([e for _, e in self.efficiency])
        inside = np.interp(units, counts, counts * listed) / units
        return np.where(units < counts[0], listed[0], np.where(units > counts[-1], listed[-1], inside))

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"resource": self.resource}
        if self.efficiency:
            body["efficiency"] = {str(m): e for m, e in self.efficiency}
        if self.t1 is not None:
            body["t1"] = self.t1
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Elasticity:
        """The inverse of ``to_json``, for records the broker wrote itself."""
        points = tuple(sorted((int(m), float(e)) for m, e in body.get("efficiency", {}).items()))
        t1 = body.get("t1")
        return cls(body["resource"], points, None if t1 is None else float(t1))


_ids = random.Random(os.urandom(32))
#: an id's clock: milliseconds in 40 bits (it wraps every ~35 years, which costs the order a moment, not uniqueness)
_CLOCK_BITS = (1 << 40) - 1


def new_action_id() -> str:
    """A millisecond clock, then 56 random bits: ids made close in time sort close, so each commit's new rows land in
    a few pages of the store's indexes on them (random ids scatter a batch over every page, and each commit then
    writes the pages it touched), and ids stay unique with no syscall per id (they name actions; not secrets)."""
    return f"act_{(int(time.time() * 1000) & _CLOCK_BITS) << 56 | _ids.getrandbits(56):024x}"


@dataclass(slots=True, eq=False)
class Action:
    """One atomic use of external resources, and its record from submission to a terminal state."""

    task: str
    kind: Kind
    demands: dict[str, Demand]
    spec: dict[str, Any] = field(default_factory=dict)
    trajectory: str | None = None
    elasticity: Elasticity | None = None
    timeout_s: float = 600.0
    idempotency_key: str | None = None
    signature: str = ""
    id: str = field(default_factory=new_action_id)
    seq: int = 0
    state: State = State.QUEUED
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    execution_s: float | None = None
    #: part of ``execution_s`` spent restoring a service to the GPUs (EOE); None for actions that never restore
    restore_s: float | None = None
    units: dict[str, int] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)
    result: Any = None
    error: dict[str, Any] | None = None
    expected_duration_s: float | None = None
    #: while it runs with resizable units: its bounds, units over time and progress (``tangram.core.malleable``)
    malleable: Malleable | None = None
    #: a finished malleable action's record as the store returned it (``malleable`` is not rebuilt)
    resized: dict[str, Any] | None = None
    #: ``spec`` as its manager parsed it (a typed value per kind): parsed once, at submit or on a recovered
    #: action's first use, then read by allocation and execution
    parsed_spec: Any = field(default=None, repr=False, compare=False)
    #: the W3C ``traceparent`` its request came with (``tangram/tracing.py``); kept in memory only
    traceparent: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.signature:
            self.signature = default_signature(self.kind, self.demands, self.spec)

    @property
    def key_resource(self) -> str | None:
        """The key elasticity resource, or None when the action is not scalable (Alg. 1 line 6)."""
        if self.elasticity is None:
            return None
        demand = self.demands.get(self.elasticity.resource)
        if demand is None or not demand.elastic:
            return None
        return self.elasticity.resource

    def min_units(self) -> dict[str, int]:
        return {name: demand.min for name, demand in self.demands.items()}

    @property
    def act_s(self) -> float | None:
        """Action completion time: from submission to the end (None until it ends)."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def timings(self) -> dict[str, float | None]:
        """Queue, execution (of which restore), broker overhead and ACT in seconds (None until known)."""
        submitted, started, finished, execution = self.submitted_at, self.started_at, self.finished_at, self.execution_s
        queue = None if started is None else started - submitted
        act = overhead = None
        if finished is not None:
            act = finished - submitted
            overhead = max(0.0, act - (queue or 0.0) - (execution or 0.0))
        return {"queue_s": queue, "execution_s": execution, "restore_s": self.restore_s, "overhead_s": overhead,
                "act_s": act}

    def to_json(self) -> dict[str, Any]:
        """The client's record. ``kind`` and ``state`` are the members themselves (a ``StrEnum`` member is its
        string to JSON encoders and in comparisons), which spares an enum lookup each on every record sent."""
        return {
            "id": self.id,
            "task": self.task,
            "trajectory": self.trajectory,
            "kind": self.kind,
            "state": self.state,
            "demand": {name: demand.to_json() for name, demand in self.demands.items()},
            "elasticity": None if self.elasticity is None else self.elasticity.to_json(),
            "spec": self.spec,
            "timeout_s": self.timeout_s,
            "idempotency_key": self.idempotency_key,
            "signature": self.signature,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "allocation": self._allocation_json() if self.units else None,
            "result": self.result,
            "error": self.error,
            "timings": self.timings(),
        }

    def _allocation_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"units": self.units, "placement": self.placement}
        resized = self.resized if self.malleable is None else self.malleable.summary(self.finished_at or time.time())
        if resized is not None:
            body["malleable"] = resized
        return body


def default_signature(kind: Kind, demands: dict[str, Demand], spec: dict[str, Any]) -> str:
    """Actions with one signature share a learned duration profile: kind, resources and, for API calls, route."""
    resources = ",".join(sorted(demands))
    if kind is Kind.API:
        return f"{kind}|{resources}|{spec.get('method', 'GET')} {spec.get('path', '/')}"
    return f"{kind}|{resources}"
