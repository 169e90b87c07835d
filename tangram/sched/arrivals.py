"""Arrivals the broker can expect: trajectories between two actions will call again soon.

Alg. 2 estimates the ACT of the actions *queued* at a pass. In agentic RL most of the next actions are not queued
yet: their trajectories are generating (they hold an environment and have nothing queued or running) and will call
within seconds. Learned per task: the think time (an action's end to its trajectory's next submit) and, per
resource, the share of next actions that demand it, their minimum units and their duration, all as EWMAs. A pass
asks for the expected next actions on one resource, soonest first, and the estimate counts them from their
expected arrival.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tangram.core.action import Action

#: a trajectory idle this many think times is taken to have ended (it deleted nothing the broker saw)
GIVE_UP_THINKS = 10.0
#: ... or this long, when its task has not learned a think time yet
GIVE_UP_UNLEARNED_S = 600.0
#: bounds on what clients can make the model remember (task names and trajectory ids are theirs)
MAX_IDLE_TRAJECTORIES = 100_000
MAX_TASKS = 10_000


@dataclass(frozen=True, slots=True)
class Expected:
    """A next action as the estimate sees it: seconds until it is submitted, units it will ask for, duration."""

    in_s: float
    units: int
    duration_s: float


@dataclass(slots=True)
class _Ewma:
    value: float
    alpha: float

    def add(self, sample: float) -> None:
        self.value += self.alpha * (sample - self.value)


@dataclass(slots=True)
class _TaskHabits:
    think_s: _Ewma
    share: dict[str, _Ewma] = field(default_factory=dict)  # per resource: share of next actions demanding it
    units: dict[str, _Ewma] = field(default_factory=dict)  # per resource: their minimum units
    duration_s: dict[str, _Ewma] = field(default_factory=dict)  # per resource: their execution time


class ArrivalModel:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.tasks: dict[str, _TaskHabits] = {}
        self.idle: dict[tuple[str, str], float] = {}  # (task, trajectory) -> when its last action ended

    def submitted(self, action: Action, now: float) -> None:
        """A trajectory's next action: its think time and shape are learned, and the trajectory is busy again."""
        if action.trajectory is None:
            return
        ended = self.idle.pop((action.task, action.trajectory), None)
        if ended is None:
            return
        habits = self.tasks.get(action.task)
        think = max(0.0, now - ended)
        if habits is None:
            if len(self.tasks) >= MAX_TASKS:
                del self.tasks[next(iter(self.tasks))]  # the task learned about longest ago
            habits = self.tasks[action.task] = _TaskHabits(_Ewma(think, self.alpha))
        else:
            habits.think_s.add(think)
        for resource in set(habits.share) | set(action.demands):
            demanded = resource in action.demands
            if resource not in habits.share:
                habits.share[resource] = _Ewma(float(demanded), self.alpha)
            else:
                habits.share[resource].add(float(demanded))
            if demanded:
                units = float(action.demands[resource].min)
                if resource in habits.units:
                    habits.units[resource].add(units)
                else:
                    habits.units[resource] = _Ewma(units, self.alpha)

    def ended(self, action: Action, now: float) -> None:
        """An action of a trajectory ended: the trajectory generates until its next one. Its execution time is
        learned as the typical duration of a next action on each resource it held."""
        if action.trajectory is None:
            return
        key = (action.task, action.trajectory)
        self.idle.pop(key, None)
        self.idle[key] = now  # last: the map stays in the order trajectories went idle
        self._give_up(now)
        habits = self.tasks.get(action.task)
        if habits is None or action.execution_s is None:
            return
        for resource in action.demands:
            if resource in habits.duration_s:
                habits.duration_s[resource].add(action.execution_s)
            else:
                habits.duration_s[resource] = _Ewma(action.execution_s, self.alpha)

    def _give_up(self, now: float) -> None:
        """Drop the trajectories idle longest once they are past their task's give-up time, and any beyond
        MAX_IDLE_TRAJECTORIES: ones that ended without the broker seeing it must not pile up."""
        while self.idle:
            key, ended = next(iter(self.idle.items()))
            if len(self.idle) <= MAX_IDLE_TRAJECTORIES and now - ended <= self._give_up_s(key[0]):
                return
            del self.idle[key]

    def _give_up_s(self, task: str) -> float:
        habits = self.tasks.get(task)
        return GIVE_UP_UNLEARNED_S if habits is None else GIVE_UP_THINKS * max(habits.think_s.value, 1e-3)

    def forget(self, task: str, trajectory: str) -> None:
        """The trajectory ended (its environment is gone): nothing more is expected of it."""
        self.idle.pop((task, trajectory), None)

    def expected(self, resource: str, now: float, limit: int,
                 holds: Callable[[str, str], bool] | None = None) -> list[Expected]:
        """The soonest ``limit`` next actions on ``resource`` from idle trajectories (those ``holds`` says still
        hold an environment), each task's share of them: a task whose next actions demand the resource one time in
        four contributes a quarter of its idle trajectories, the soonest."""
        by_task: dict[str, list[float]] = {}
        for (task, trajectory), ended in list(self.idle.items()):
            if now - ended > self._give_up_s(task) or (holds is not None and not holds(task, trajectory)):
                del self.idle[(task, trajectory)]
                continue
            habits = self.tasks.get(task)
            if habits is None:
                continue
            by_task.setdefault(task, []).append(max(0.0, ended + habits.think_s.value - now))
        out: list[Expected] = []
        for task, waits in by_task.items():
            habits = self.tasks[task]
            share = habits.share.get(resource)
            if share is None or share.value <= 0 or resource not in habits.duration_s:
                continue
            count = math.ceil(share.value * len(waits) - 1e-9)
            units = max(1, round(habits.units[resource].value))
            duration = habits.duration_s[resource].value
            out.extend(Expected(wait, units, duration) for wait in sorted(waits)[:count])
        out.sort(key=lambda e: e.in_s)
        return out[:limit]
