"""SLO admission for RL tasks sharing a GPU pool (issue 18; RollMux/Weave §4.2, worst-case planning).

A task states the slowdown of its training step it tolerates against a dedicated deployment of its reward model
(say 1.2), and declares its step at its worst: reward actions per step, the longest one action can take, the rest
of the step (rollout and training) at its shortest. A task is admitted to the pool only if every task's predicted
slowdown, its own included, stays within its SLO. Both sides of the ratio are planned on the worst case, as RollMux
does (its Algorithm 1, line 10).

The bound on a task's reward phase in the pool is a response-time analysis (a fixed point, as Joseph and Pandya's,
for a work-conserving pool of ``G`` GPUs with non-preemptive actions, Graham's list-scheduling bound):

    R_k = p_max + C_k + (W_k + sum_{j != k} (1 + floor(R_k / O_j)) * W_j) / G

* ``W_j``: GPU-seconds of task j's reward phase at its worst: each action at its longest (or, with the mean and
  deviation of its duration declared, the 99.9th percentile of their sum: RollMux's "conservative stochastic
  planning" without its maximum-length bound), at the least efficient DoP it asks for, and each paying a restore
  of its service (an action never finds its service resident: FCFS interleaving several services is that bad);
* ``O_j``: the shortest gap between two of j's reward phases (the rest of its step: training, then the next
  rollout until its first reward). Every two phases of j that meet a window of ``R`` have such a gap between them
  inside it, so at most ``1 + floor(R / O_j)`` of them meet it;
* ``p_max``: the longest action in the pool with its restore (one already running when the phase starts holds
  its GPUs);
* ``C_k``: one restore of k's own service.

A dedicated deployment serves the task alone on ``dedicated_gpus`` with its service resident:
``R_solo = p + W_solo / G_k``. Predicted slowdown: ``(other_s + R_k) / (other_s + R_solo)``.

That bound assumes every other task's phase may meet k's at its worst: on a busy pool it admits fewer tasks than
dedicated deployments would hold. So a task the shared bound does not hold gets GPUs *reserved*: the broker orders
its actions ahead of every other task's while it holds fewer than ``g_k`` GPUs (``tangram/sched/reserved_shares.py``),
and the GPUs it does not use serve anyone. With the reservations summing to at most ``G``, k's own work then runs
on at least ``g_k`` GPUs once the actions holding them end, whatever the others do:

    R_k = p_max + C_k + p_k + W_k / g_k

(``p_k``: k's longest action, the last one to start). Each task gets the fewest GPUs that keep it within its SLO, 0
where the shared bound already does; a task's prediction is the smaller of its two bounds, both hold under this
order (the shared one asks only that the pool work whenever an action waits). A set of plans is admitted only if
the reservations fit the pool. Departures: RollMux orchestrates the phases of a group so that they do not meet;
the broker does not hold a task's rollout back, so it guarantees GPUs instead. The reservation counts GPUs at the
actions' minimum DoP; an action Algorithm 1 holds back to widen an earlier one can delay a reserved task beyond
the bound (none did in ``gpu-slo``, which measures attainment).

The bounds hold only for GPU load that comes from planned tasks: a task without an SLO adds load no plan counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, Strict

from tangram.core.config_tables import TABLE, Count, PositiveSeconds, Seconds, Text

#: the fixed point stops here: a phase this many times its task's step period is as good as unbounded
UNBOUNDED_PERIODS = 1000
#: the standard normal's 99.9th percentile: a phase's work planned from its actions' mean and deviation
PHASE_Z = 3.09


@dataclass(frozen=True)
class SloPlan:
    """One task's SLO and its step at its worst (``[tasks.NAME.slo]`` or ``PUT /v1/tasks/NAME/slo``)."""

    __pydantic_config__ = TABLE

    #: the step time the task tolerates, as a multiple of its step on a dedicated deployment (RollMux: 1-2)
    slowdown: Annotated[float, Strict(), Field(ge=1)]
    #: the reward service its actions call
    service: Text
    #: reward actions per step
    actions: Count
    #: the longest one action takes on one GPU (RollMux plans each response at the maximum token length)
    action_s: PositiveSeconds
    #: the rest of a step at its shortest: the gap from the last reward of a step to the first of the next (training,
    #: then the next rollout until its first trajectory ends)
    other_s: Seconds
    #: GPUs of the dedicated deployment the slowdown is measured against
    dedicated_gpus: Count
    #: the least parallel efficiency E(m) among the DoPs its actions ask for (1: DoP 1 only)
    efficiency: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0
    #: optional: the mean and standard deviation of one action on one GPU. Given, a phase's work is planned at the
    #: 99.9th percentile of its sum rather than every action at its longest (below)
    action_mean_s: PositiveSeconds | None = None
    action_sd_s: Seconds = 0.0

    def work_s(self) -> float:
        """Seconds on one GPU of one phase's actions, at the worst the plan admits: every action at ``action_s``, or,
        with the mean and deviation declared, their sum's 99.9th percentile (independent durations, the central
        limit over ``actions``), never above every action at its longest."""
        longest = self.actions * self.action_s
        if self.action_mean_s is None:
            return longest
        quantile = self.actions * self.action_mean_s + PHASE_Z * self.action_sd_s * math.sqrt(self.actions)
        return min(longest, quantile)

    def solo_phase_s(self) -> float:
        """The reward phase on the dedicated deployment, at its worst, service resident."""
        return self.action_s + self.work_s() / self.efficiency / self.dedicated_gpus

    def slowdown_at(self, phase_s: float) -> float:
        """The step slowdown with a reward phase of ``phase_s`` in the pool against the dedicated one."""
        return (self.other_s + phase_s) / (self.other_s + self.solo_phase_s())


@dataclass(frozen=True)
class Pool:
    """The GPUs the planned tasks share, and each service's expected restore (switch) time on them."""

    gpus: int
    restore_s: Mapping[str, float]

    def phase_gpu_s(self, plan: SloPlan) -> float:
        """GPU-seconds of one reward phase of ``plan`` at its worst: every action restores its service."""
        return plan.work_s() / plan.efficiency + plan.actions * self.restore_s.get(plan.service, 0.0)


@dataclass(frozen=True)
class Prediction:
    """One task's planned reward phase in the pool and on its dedicated deployment, and their step ratio."""

    phase_s: float  # math.inf: the pool cannot bound it
    solo_phase_s: float
    slowdown: float
    slo: float
    #: GPUs reserved for the task's actions; 0: the shared bound holds it (or no reservation would)
    reserved_gpus: int = 0

    @property
    def within(self) -> bool:
        return self.slowdown <= self.slo


def _blocking(task: str, plans: Mapping[str, SloPlan], pool: Pool) -> float:
    """``p_max + C_k``: the longest action in the pool with its restore (holding GPUs when k's phase starts), and a
    restore of k's own service."""
    longest = max(plan.action_s + pool.restore_s.get(plan.service, 0.0) for plan in plans.values())
    return longest + pool.restore_s.get(plans[task].service, 0.0)


def phase_bound(task: str, plans: Mapping[str, SloPlan], pool: Pool) -> float:
    """The bound ``R_task`` on the task's reward phase with every task of ``plans`` in the pool; inf if the fixed
    point does not converge (the pool is overloaded)."""
    own = plans[task]
    others = [(pool.phase_gpu_s(plan), plan.other_s) for name, plan in plans.items() if name != task]
    fixed = _blocking(task, plans, pool)
    own_work = pool.phase_gpu_s(own)
    bound = fixed + own_work / pool.gpus
    limit = UNBOUNDED_PERIODS * max(own.other_s, bound)
    while True:
        interference = sum((1 + math.floor(bound / gap)) * work if gap > 0 else math.inf for work, gap in others)
        following = fixed + (own_work + interference) / pool.gpus
        if following <= bound or following > limit:
            return following if following <= limit else math.inf
        bound = following


def reserved_bound(task: str, plans: Mapping[str, SloPlan], pool: Pool, gpus: int) -> float:
    """The bound on the task's reward phase with ``gpus`` reserved for it; inf with none."""
    if gpus <= 0:
        return math.inf
    own = plans[task]
    return _blocking(task, plans, pool) + own.action_s + pool.phase_gpu_s(own) / gpus


def least_reservation(task: str, plans: Mapping[str, SloPlan], pool: Pool) -> int | None:
    """The fewest GPUs whose reservation keeps the task within its SLO; None if even the whole pool would not."""
    own = plans[task]
    # the longest phase within its SLO, solved for: where the search starts; the check is the prediction's own
    longest = own.slowdown * (own.other_s + own.solo_phase_s()) - own.other_s
    room = longest - _blocking(task, plans, pool) - own.action_s
    if room <= 0:
        return None
    gpus = max(1, math.ceil(pool.phase_gpu_s(own) / room))
    while gpus <= pool.gpus and own.slowdown_at(reserved_bound(task, plans, pool, gpus)) > own.slowdown:
        gpus += 1  # float rounding of the ceil
    return gpus if gpus <= pool.gpus else None


def predict(plans: Mapping[str, SloPlan], pool: Pool, reserve: bool = True) -> dict[str, Prediction]:
    """Every task's prediction with all of ``plans`` in the pool: each task's reservation is the least that keeps
    it within its SLO (0 where the shared bound does). If the reservations exceed the pool, each reserved task is
    predicted on what the others' leave it, so the plans cannot all hold. ``reserve=False``: the shared bound
    alone, as without reservations (the simulator's baseline)."""
    shared = {task: phase_bound(task, plans, pool) for task in plans}
    wanted: dict[str, int] = {}
    for task, plan in plans.items():
        if not reserve or plan.slowdown_at(shared[task]) <= plan.slowdown:
            wanted[task] = 0
        else:
            least = least_reservation(task, plans, pool)
            wanted[task] = pool.gpus if least is None else least
    total = sum(wanted.values())
    out = {}
    for task, plan in plans.items():
        gpus = wanted[task]
        if total > pool.gpus and gpus:
            gpus = max(0, pool.gpus - (total - gpus))
        phase = min(shared[task], reserved_bound(task, plans, pool, gpus))
        out[task] = Prediction(phase, plan.solo_phase_s(), plan.slowdown_at(phase), plan.slowdown, gpus)
    return out


def reservations(plans: Mapping[str, SloPlan], pool: Pool) -> dict[str, int]:
    """The GPUs reserved for each task with a reservation (what the broker's order enforces)."""
    return {task: p.reserved_gpus for task, p in predict(plans, pool).items() if p.reserved_gpus}


def first_breach(plans: Mapping[str, SloPlan], pool: Pool,
                 reserve: bool = True) -> tuple[str, Prediction] | None:
    """The task whose SLO the plans would break (the worst one, relative to its SLO); None if all hold."""
    broken = [(prediction.slowdown / prediction.slo, task, prediction)
              for task, prediction in predict(plans, pool, reserve).items() if not prediction.within]
    if not broken:
        return None
    _, task, prediction = max(broken, key=lambda entry: entry[0])
    return task, prediction
