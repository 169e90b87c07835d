"""RL tasks as consecutive steps with a barrier, sharing the stations: what SLO admission is measured on (issue 18).

Each step of a task rolls out its batch (every trajectory starts at the step's start and generates for its own
rollout time), each trajectory then makes one reward call, and the step trains for ``train_s`` once the last reward
is back; the next step starts then. Unlike ``training.py``, several tasks run at once on one pool, each at its own
pace, so one task's reward phase meets the others' wherever their steps fall.

A task's *slowdown* in a step is that step's duration in the pool over the same step's duration on its dedicated
deployment (the task alone on its own GPUs, same calls); the step is within its SLO if the slowdown is at most the
task's SLO. Attainment is the fraction of steps within (RollMux's measure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tangram.sim.cluster import Cluster
from tangram.sim.engine import Policy, simulate
from tangram.sim.trace import Call, Trace, Trajectory
from tangram.slo.plan import SloPlan


@dataclass(frozen=True)
class SloTask:
    """One RL task: its reward calls step by step (each call's think time is its trajectory's rollout), its
    training time per step, and the plan it declares for admission."""

    name: str
    steps: tuple[tuple[Call, ...], ...]
    train_s: float
    plan: SloPlan


@dataclass
class StepFeed:
    """Starts each task's next step when the last trajectory of its current one ends, and times every step."""

    tasks: Sequence[SloTask]
    #: task -> each finished step's duration (rollout with its rewards, then training)
    step_s: dict[str, list[float]] = field(default_factory=dict)
    _open: dict[str, tuple[int, float, int]] = field(default_factory=dict)  # task -> (step, start, trajectories left)

    def first(self) -> Trace:
        """Every task's first step, all starting at 0 (their reward phases meet at once: the adversarial start)."""
        trace = Trace("slo-tasks", 0, {"tasks": [task.name for task in self.tasks]})
        for task in self.tasks:
            trace.trajectories.extend(self._step(task, 0, 0.0))
        return trace

    def __call__(self, trajectory: Trajectory, now: float) -> list[Trajectory]:
        step, start, left = self._open[trajectory.task]
        if left > 1:
            self._open[trajectory.task] = (step, start, left - 1)
            return []
        task = next(t for t in self.tasks if t.name == trajectory.task)
        self.step_s.setdefault(task.name, []).append(now + task.train_s - start)
        if step + 1 == len(task.steps):
            del self._open[task.name]
            return []
        return self._step(task, step + 1, now + task.train_s)

    def _step(self, task: SloTask, step: int, start: float) -> list[Trajectory]:
        calls = task.steps[step]
        self._open[task.name] = (step, start, len(calls))
        return [Trajectory(f"{task.name}/{step}/{i}", task.name, start, (call,)) for i, call in enumerate(calls)]


def run_steps(tasks: Sequence[SloTask], cluster: Cluster, policy: Policy,
              name: str) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Every step of every task in ``tasks`` on ``cluster``: task -> its steps' durations, and the stations'
    figures."""
    feed = StepFeed(tasks)
    result = simulate(feed.first(), cluster, policy, name, follow=feed)
    return feed.step_s, result.stats


@dataclass(frozen=True)
class Attainment:
    """One task's steps in the pool against the same steps on its dedicated deployment."""

    task: str
    slo: float
    slowdowns: tuple[float, ...]

    @property
    def within(self) -> int:
        return sum(slowdown <= self.slo for slowdown in self.slowdowns)

    @property
    def fraction(self) -> float:
        return self.within / len(self.slowdowns)


def attainment(task: SloTask, pooled_s: Sequence[float], dedicated_s: Sequence[float]) -> Attainment:
    return Attainment(task.name, task.plan.slowdown, tuple(p / d for p, d in zip(pooled_s, dedicated_s)))
