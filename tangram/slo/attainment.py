"""Measured SLO attainment of the tasks with a plan (issue 18): how often a task's reward phase in the shared pool
stayed within the slowdown it tolerates against a dedicated deployment.

The broker tells the tracker of every action it queues and ends. A *phase* of task k opens when one of k's reward
actions on its plan's service is queued while none of them is queued or running, and closes when none is; a
closed phase is one window. What the same actions would have taken on the dedicated deployment is estimated from
what they did here: their service resident (execution without the restore), spread over the deployment's GPUs after
the longest one, as the plan's ``R_solo`` is. The window is within SLO when

    other_s + observed_s <= slowdown * (other_s + solo_s),   solo_s = longest + sum(execution * gpus) / dedicated_gpus

so a step whose reward phase was slowed by the pool no more than the SLO allows counts as attained.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tangram.core.action import Action, Kind
from tangram.slo.plan import SloPlan


@dataclass
class _Phase:
    opened_at: float
    #: the phase's actions still queued or running
    open: set[str] = field(default_factory=set)
    longest_s: float = 0.0
    gpu_s: float = 0.0


@dataclass
class Attainment:
    """One task's windows so far."""

    windows: int = 0
    within: int = 0
    #: the last closed window's step slowdown (inf: a phase with no execution at all took time)
    last_slowdown: float | None = None

    @property
    def fraction(self) -> float | None:
        return self.within / self.windows if self.windows else None


class SloAttainment:
    """Reward phases of the planned tasks, each closed one judged against its task's plan."""

    def __init__(self, service_of: Callable[[Action], str], resource: str) -> None:
        """``service_of``: the reward service a (validated) reward action calls; ``resource``: the GPUs' name in
        actions' units."""
        self._service_of = service_of
        self._resource = resource
        self._plans: Mapping[str, SloPlan] = {}
        self._phases: dict[str, _Phase] = {}
        self.tasks: dict[str, Attainment] = {}

    def plan(self, plans: Mapping[str, SloPlan]) -> None:
        """Judge by ``plans`` from now on. A task no longer planned is forgotten; an open phase whose task's
        service or step changed is dropped (its actions were planned otherwise)."""
        for task in list(self._phases):
            if plans.get(task) != self._plans.get(task):
                del self._phases[task]
        self.tasks = {task: self.tasks.get(task, Attainment()) for task in plans}
        self._plans = dict(plans)

    def submitted(self, action: Action) -> None:
        plan = self._plans.get(action.task)
        if plan is None or action.kind is not Kind.REWARD or self._service_of(action) != plan.service:
            return
        phase = self._phases.get(action.task)
        if phase is None:
            phase = self._phases[action.task] = _Phase(action.submitted_at)
        phase.open.add(action.id)

    def ended(self, action: Action) -> None:
        phase = self._phases.get(action.task)
        if phase is None or action.id not in phase.open:
            return
        phase.open.discard(action.id)
        execution = max(0.0, (action.execution_s or 0.0) - (action.restore_s or 0.0))
        phase.longest_s = max(phase.longest_s, execution)
        phase.gpu_s += execution * action.units.get(self._resource, 0)
        if not phase.open:
            del self._phases[action.task]
            self._close(action.task, phase, (action.finished_at or phase.opened_at) - phase.opened_at)

    def _close(self, task: str, phase: _Phase, observed_s: float) -> None:
        plan = self._plans[task]
        solo_s = phase.longest_s + phase.gpu_s / plan.dedicated_gpus
        took, alone = plan.other_s + observed_s, plan.other_s + solo_s
        attained = self.tasks[task]
        attained.windows += 1
        attained.within += int(took <= plan.slowdown * alone)
        attained.last_slowdown = took / alone if alone > 0 else 1.0 if took <= 0 else math.inf
