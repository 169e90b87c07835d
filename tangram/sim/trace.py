"""Traces: trajectories as the sequence of actions they make, with the LLM generation time between them.

A trace holds the *true* cost of every call (what the simulator charges) and what a client would declare to the
broker (a profiled T1, or nothing). Saved as JSON so a run can be replayed by the simulator or, time-compressed,
against a real broker (``replay.py``).
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tangram.core.action import Elasticity

#: call kinds: a non-scalable tool call on one core, an elastic test run on cores, a reward inference on GPUs,
#: a call to a rate-limited API
KINDS = ("tool", "test", "reward", "api")


@functools.lru_cache(maxsize=65536)
def _profile(efficiency: tuple[tuple[int, float], ...]) -> Elasticity:
    return Elasticity("", efficiency)


@dataclass(frozen=True, slots=True)
class Call:
    kind: str
    think_s: float  # LLM generation before the call is made
    work_s: float  # true duration on one unit of the key resource (T1); for "api", the upstream's latency
    target: str | None = None  # reward service or API resource name
    efficiency: tuple[tuple[int, float], ...] = ()  # true E(m) of an elastic call
    estimate_s: float | None = None  # the T1 a client declares (profiled in advance); None: the broker learns

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown call kind {self.kind!r}; known: {KINDS}")
        if self.think_s < 0 or self.work_s <= 0:
            raise ValueError(f"a call needs think_s >= 0 and work_s > 0, got {self.think_s}, {self.work_s}")
        if self.kind in ("reward", "api") and not self.target:
            raise ValueError(f"a {self.kind} call names its target")

    @property
    def elastic(self) -> bool:
        return len(self.efficiency) > 1

    def elasticity(self, resource: str, declared: bool = True) -> Elasticity | None:
        """The profile on ``resource``: with the declared T1 (what a client sends) or the true one."""
        if not self.elastic:
            return None
        return Elasticity(resource, self.efficiency, self.estimate_s if declared else self.work_s)

    def speedup(self, units: float) -> float:
        """Times faster than on one unit: ``E(m)·m`` if elastic, else 1; below one unit (a CPU share),
        proportionally slower."""
        if units <= 1 or not self.elastic:
            return min(units, 1.0)
        return _profile(self.efficiency).efficiency_at(units) * units  # type: ignore[arg-type]

    def duration(self, units: float) -> float:
        """True execution time on ``units`` of the key resource."""
        return self.work_s / self.speedup(units)

    def fastest_s(self) -> float:
        """Its true execution time on the fastest of its listed unit counts (the speed-up is piecewise linear
        between them, so none in between is faster); its one time if not elastic."""
        return min((self.duration(m) for m, _ in self.efficiency), default=self.work_s)


@dataclass(frozen=True, slots=True)
class Trajectory:
    id: str
    task: str
    start_s: float
    calls: tuple[Call, ...]
    memory_mb: int = 4096  # what its sandbox reserves for its life (a pod's request, an AOE environment)

    def critical_path_s(self) -> float:
        """When it would end with no queueing and no overhead, each call on its fastest unit count: what no
        scheduler can beat, since its LLM generation between calls is not the broker's."""
        return self.start_s + sum(c.think_s + c.fastest_s() for c in self.calls)


@dataclass(slots=True)
class Trace:
    workload: str
    seed: int
    params: dict[str, Any]
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return sum(len(t.calls) for t in self.trajectories)

    def critical_path_s(self) -> float:
        """The least possible rollout makespan: its longest trajectory's critical path."""
        return max((t.critical_path_s() for t in self.trajectories), default=0.0)

    def unqueued_trajectory_act_s(self) -> float:
        """The least possible mean ACT per trajectory: every call at its fastest count, none waiting and no
        overhead (what no scheduler of the same calls can beat)."""
        return statistics.fmean(sum(c.fastest_s() for c in t.calls) for t in self.trajectories) \
            if self.trajectories else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "seed": self.seed, "params": self.params,
                "trajectories": [asdict(t) for t in self.trajectories]}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Trace:
        trajectories = []
        for t in body["trajectories"]:
            calls = tuple(Call(**{**c, "efficiency": tuple(tuple(p) for p in c.get("efficiency", ()))})
                          for c in t["calls"])
            trajectories.append(Trajectory(t["id"], t["task"], t["start_s"], calls, t.get("memory_mb", 4096)))
        return cls(body["workload"], body["seed"], body.get("params", {}), trajectories)

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(orjson.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(orjson.loads(Path(path).read_bytes()))


def compressed(trace: Trace, factor: float) -> Trace:
    """The same trace with every duration divided by ``factor`` (for a real replay on a small machine)."""
    if not factor > 0:
        raise ValueError(f"factor must be positive, got {factor}")
    trajectories = [Trajectory(t.id, t.task, t.start_s / factor,
                               tuple(Call(c.kind, c.think_s / factor, c.work_s / factor, c.target, c.efficiency,
                                          None if c.estimate_s is None else c.estimate_s / factor)
                                     for c in t.calls), t.memory_mb)
                    for t in trace.trajectories]
    return Trace(trace.workload, trace.seed, {**trace.params, "compressed_by": factor}, trajectories)
