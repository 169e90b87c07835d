"""What a simulated (or replayed) run produced, call by call, and the figures the paper reports from it.

The paper's main metric (§6.3) is the *total ACT per trajectory*, averaged over trajectories: the time a
trajectory spends waiting for its external calls. Table 1 breaks the ACT of a call into execution, queueing and
system overhead (restores, dispatch, sandbox creation).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class CallRecord:
    trajectory: str
    index: int  # position of the call in its trajectory
    kind: str
    target: str | None
    submit_s: float
    start_s: float  # when its resources were granted (the end of queueing)
    finish_s: float
    exec_s: float  # pure execution
    overhead_s: float  # restore, dispatch, sandbox or pod start: the rest of start -> finish
    units: int = 1  # key-resource units it ran on (cores, GPUs); 0 where none were granted
    pool: str = ""  # node (or instance) it ran on
    attempts: int = 1
    failed: bool = False
    unit_s: float = 0.0  # key-resource units x seconds held while executing (core-seconds)
    resizes: int = 0  # times its units changed while it ran (malleable actions)
    history: tuple[tuple[float, int], ...] = ()  # (instant, units from then on) from its start, if it was resized

    def holding(self) -> list[tuple[float, float, int]]:
        """The units it held over ``[start, finish)``, as (from, to, units) intervals."""
        points = self.history or ((self.start_s, self.units),)
        ends = [t for t, _ in points[1:]] + [self.finish_s]
        return [(t, end, units) for (t, units), end in zip(points, ends)]

    @property
    def queue_s(self) -> float:
        return self.start_s - self.submit_s

    @property
    def act_s(self) -> float:
        return self.finish_s - self.submit_s


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass(slots=True)
class RunResult:
    policy: str
    records: list[CallRecord]
    #: what the driver measured besides the records (scheduling passes, wall time, restores, ...)
    stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        records = self.records
        per_trajectory: dict[str, float] = defaultdict(float)
        for r in records:
            per_trajectory[r.trajectory] += r.act_s
        acts = [r.act_s for r in records]
        out: dict[str, Any] = {
            "policy": self.policy,
            "trajectories": len(per_trajectory),
            "calls": len(records),
            "failed_calls": sum(r.failed for r in records),
            "mean_trajectory_act_s": statistics.fmean(per_trajectory.values()) if records else 0.0,
            "mean_act_s": statistics.fmean(acts) if records else 0.0,
            "p50_act_s": percentile(acts, 0.5),
            "p99_act_s": percentile(acts, 0.99),
            "mean_exec_s": statistics.fmean(r.exec_s for r in records) if records else 0.0,
            "mean_queue_s": statistics.fmean(r.queue_s for r in records) if records else 0.0,
            "mean_overhead_s": statistics.fmean(r.overhead_s for r in records) if records else 0.0,
            "makespan_s": max((r.finish_s for r in records), default=0.0),
            "by_kind": {},
        }
        kinds: dict[str, list[CallRecord]] = defaultdict(list)
        for r in records:
            kinds[r.kind].append(r)
        for kind, rows in sorted(kinds.items()):
            out["by_kind"][kind] = {
                "calls": len(rows),
                "mean_act_s": statistics.fmean(r.act_s for r in rows),
                "mean_exec_s": statistics.fmean(r.exec_s for r in rows),
                "mean_queue_s": statistics.fmean(r.queue_s for r in rows),
                "mean_overhead_s": statistics.fmean(r.overhead_s for r in rows),
                "mean_units": statistics.fmean(r.units for r in rows),
                "unit_s": sum(r.unit_s for r in rows),
                "p99_queue_s": percentile([r.queue_s for r in rows], 0.99),
                "resizes": sum(r.resizes for r in rows),
                "failed": sum(r.failed for r in rows),
            }
        out.update(self.stats)
        return out

    def to_json(self, with_records: bool = False) -> dict[str, Any]:
        body = self.summary()
        if with_records:
            body["records"] = [asdict(r) for r in self.records]
        return body
