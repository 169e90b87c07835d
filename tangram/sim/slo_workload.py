"""The tasks offered to a shared GPU pool in ``gpu-slo``: RL tasks with a reward model each, each step's rewards
bounded by a maximum length, as RollMux's jobs are by their maximum token count (issue 18).

Every figure here is assumed (``--set slo.FIELD=VALUE``): the papers give no per-step reward workload. RollMux
samples each job's SLO from Unif(1, 2) (§7.1), and so does this.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tangram.sim.cluster import ServiceModel
from tangram.sim.task_steps import SloTask
from tangram.sim.trace import Call
from tangram.slo.plan import SloPlan

#: the DoPs a reward model runs at, and its parallel efficiency there (the least is 0.75, at DoP 4)
SLO_EFFICIENCY = ((1, 1.0), (2, 0.9), (4, 0.75))


@dataclass(frozen=True)
class SloTaskParams:
    """How the offered tasks are drawn."""

    candidates: int = 40  # tasks offered, in arrival order
    steps: int = 4  # steps each task runs in a simulated run
    batches: tuple[int, ...] = (128, 256, 512, 1024)  # trajectories (reward calls) per step, drawn uniformly
    reward_median_s: float = 2.0  # one reward on one GPU, median (assumed)
    reward_sigma: float = 0.5
    reward_cap: float = 3.0  # the longest reward is this many medians (the maximum length; assumed)
    rollout_low_s: float = 120.0  # a task's median rollout time is drawn between these (assumed)
    rollout_high_s: float = 600.0
    rollout_sigma: float = 0.5  # each trajectory's rollout around its task's median, within [0.5, 3] medians
    train_s: float = 120.0  # the training phase of a step (assumed, as ``step.train_s``)
    # 1: a step's rewards are scored once its whole rollout is done (verl's synchronous reward stage); 0: each as its
    # trajectory ends (agentic rollouts that call the reward model themselves)
    batched_rewards: int = 1
    # a task's dedicated reward deployment is the fewest GPUs (1, 2, 4 or 8: one node at most) on which its typical
    # rewards of a step take at most this share of its median rollout: what its owner would reserve (assumed)
    dedicated_share: float = 0.25
    slo_low: float = 1.0  # each task's SLO is drawn from Unif(slo_low, slo_high) (RollMux §7.1)
    slo_high: float = 2.0
    unchecked: int = 4  # the scenario also runs this many times the tasks dedicated deployments hold, unchecked


    def reward_moments(self) -> tuple[float, float]:
        """The mean and standard deviation of one reward on one GPU, as a client that profiled its rewards would
        declare them: the lognormal's, before the cap (which only lowers both)."""
        spread = math.exp(self.reward_sigma ** 2)
        return self.reward_median_s * math.sqrt(spread), self.reward_median_s * math.sqrt(spread * (spread - 1))


def _clipped_lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, median * math.exp(rng.gauss(0.0, sigma))))


def _step(rng: random.Random, params: SloTaskParams, service: str, batch: int, rollout_s: float) -> tuple[Call, ...]:
    """One step's reward calls, each after its trajectory's rollout (or after the slowest one, batched)."""
    rollouts = [_clipped_lognormal(rng, rollout_s, params.rollout_sigma, 0.5 * rollout_s, 3 * rollout_s)
                for _ in range(batch)]
    if params.batched_rewards:
        rollouts = [max(rollouts)] * batch
    worst_s = params.reward_median_s * params.reward_cap
    return tuple(Call("reward", think, _clipped_lognormal(rng, params.reward_median_s, params.reward_sigma, 0.05,
                                                          worst_s), service, SLO_EFFICIENCY)
                 for think in rollouts)


def slo_tasks(params: SloTaskParams, seed: int) -> list[SloTask]:
    """``params.candidates`` tasks, each with a reward service of its own, in the order they ask to be admitted.
    Each declares its worst case: every reward at the cap, at the least efficient DoP, rollouts at their shortest."""
    rng = random.Random(seed)
    worst_s = params.reward_median_s * params.reward_cap
    tasks = []
    for i in range(params.candidates):
        name = f"task{i}"
        batch = rng.choice(params.batches)
        rollout_s = rng.uniform(params.rollout_low_s, params.rollout_high_s)
        steps = tuple(_step(rng, params, name, batch, rollout_s) for _ in range(params.steps))
        typical_gpu_s = batch * params.reward_median_s
        dedicated = next((g for g in (1, 2, 4) if typical_gpu_s / g <= params.dedicated_share * rollout_s), 8)
        plan = SloPlan(slowdown=round(rng.uniform(params.slo_low, params.slo_high), 2), service=name, actions=batch,
                       action_s=worst_s, other_s=0.5 * rollout_s + params.train_s, dedicated_gpus=dedicated,
                       efficiency=min(e for _, e in SLO_EFFICIENCY))
        tasks.append(SloTask(name, steps, params.train_s, plan))
    return tasks


def slo_service(task: SloTask) -> ServiceModel:
    """The task's reward model on the pool: an 8B model (the defaults) at the DoPs of ``SLO_EFFICIENCY``."""
    return ServiceModel(task.plan.service, dops=tuple(d for d, _ in SLO_EFFICIENCY))
