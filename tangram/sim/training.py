"""RL training as consecutive steps (the paper's step duration and Fig. 6): what a shorter ACT buys end to end.

One step rolls out a fresh batch (every trajectory starts when the step starts; the rollout ends with the last
call of its slowest trajectory, §2.1) and then trains on it for ``train_s`` before the next step's rollout starts.
A step's duration is its rollout's makespan plus the training time; the paper reports their mean over ten steps
(§6.2). Fig. 6 plots the mean ACT of the calls ending in each consecutive time window of the run.

Each step is simulated on its own, from a cold station: nothing the broker learned in one step (durations, GPU
residency) is carried to the next. That costs the broker its first restores of every step; it favours the baseline.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tangram.sim.cluster import Cluster
from tangram.sim.engine import Policy, simulate
from tangram.sim.trace import Trace


@dataclass(frozen=True)
class StepParams:
    """How a training run is cut into steps (``--set step.FIELD=VALUE``)."""

    steps: int = 10  # the paper's step duration is the mean over ten steps (§6.2)
    train_s: float = 120.0  # the training phase of a step, after its rollout (assumed; the paper gives none)
    window_s: float = 30.0  # Fig. 6's time window (assumed; the paper does not say)


def step_seed(seed: int, step: int) -> int:
    """The trace seed of ``step`` in the run of ``seed``: every step rolls out a batch of its own."""
    return seed * 1000 + step


@dataclass
class TrainingRun:
    """Each step's rollout makespan and its trace's critical path (the most any scheduler could shorten it to),
    and every call's (end on the run's clock, ACT), of one policy."""

    policy: str
    train_s: float
    rollouts_s: list[float]
    critical_paths_s: list[float]
    calls: list[tuple[float, float]]
    trajectory_acts: list[float]
    failed_calls: int = 0

    @property
    def step_s(self) -> float:
        return statistics.fmean(self.rollouts_s) + self.train_s

    def windows(self, window_s: float) -> list[tuple[float, float | None, int]]:
        """(window start, mean ACT of the calls ending in it, how many) for every window up to the last call's;
        None where no call ends (the training phases): a plot breaks its line there."""
        buckets: dict[int, list[float]] = defaultdict(list)
        for end, act in self.calls:
            buckets[int(end // window_s)].append(act)
        last = max(buckets, default=-1)
        return [(index * window_s, statistics.fmean(buckets[index]) if index in buckets else None,
                 len(buckets.get(index, ()))) for index in range(last + 1)]

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "steps": len(self.rollouts_s), "mean_step_s": self.step_s,
                "mean_rollout_s": statistics.fmean(self.rollouts_s), "train_s": self.train_s,
                "rollouts_s": [round(r, 3) for r in self.rollouts_s],
                "mean_critical_path_s": statistics.fmean(self.critical_paths_s),
                "calls": len(self.calls), "failed_calls": self.failed_calls,
                "mean_trajectory_act_s": statistics.fmean(self.trajectory_acts),
                "mean_act_s": statistics.fmean(act for _, act in self.calls)}


def train(make_trace: Callable[[int], Trace], cluster: Cluster, policy: Policy, name: str, params: StepParams,
          seed: int) -> TrainingRun:
    """``params.steps`` steps of rollout then training, the rollouts' traces from ``make_trace(step_seed)``."""
    clock = 0.0
    rollouts: list[float] = []
    critical_paths: list[float] = []
    calls: list[tuple[float, float]] = []
    trajectory_acts: list[float] = []
    failed = 0
    for step in range(params.steps):
        trace = make_trace(step_seed(seed, step))
        critical_paths.append(trace.critical_path_s())
        result = simulate(trace, cluster, policy, name)
        per_trajectory: dict[str, float] = defaultdict(float)
        for record in result.records:
            calls.append((clock + record.finish_s, record.act_s))
            per_trajectory[record.trajectory] += record.act_s
        trajectory_acts += per_trajectory.values()
        failed += sum(r.failed for r in result.records)
        rollout = max((r.finish_s for r in result.records), default=0.0)
        rollouts.append(rollout)
        clock += rollout + params.train_s
    return TrainingRun(name, params.train_s, rollouts, critical_paths, calls, trajectory_acts, failed)
