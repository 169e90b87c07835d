"""The paper's AI coding batch as several RL tasks sharing one cluster (issue 40): how many tasks there are and
how unevenly the batch is split among them decide how evenly a hash of task names loads broker partitions.

Each task's trajectories are the coding workload's (``workloads.ai_coding``) under a seed of its own; all tasks'
rollouts start together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from tangram.sim.trace import Trace
from tangram.sim.workloads import CodingParams, ai_coding


@dataclass(frozen=True)
class TaskMix:
    """``tasks`` RL tasks whose batches are Zipf(``skew``) shares of the whole (0: even)."""

    tasks: int = 16
    skew: float = 1.0

    def __post_init__(self) -> None:
        if self.tasks < 1 or self.skew < 0:
            raise ValueError(f"a task mix needs tasks >= 1 and skew >= 0, got {self.tasks}, {self.skew}")

    @property
    def label(self) -> str:
        return f"{self.tasks} tasks, skew {self.skew:g}"

    def batches(self, batch: int) -> list[int]:
        """``batch`` trajectories split by the Zipf weights (largest remainders), the most popular task first."""
        weights = [1.0 / (rank + 1) ** self.skew for rank in range(self.tasks)]
        exact = [batch * w / sum(weights) for w in weights]
        shares = [int(x) for x in exact]
        by_remainder = sorted(range(self.tasks), key=lambda k: (shares[k] - exact[k], k))
        for k in by_remainder[:batch - sum(shares)]:
            shares[k] += 1
        return shares


def task_name(index: int, seed: int) -> str:
    """Task names differ from seed to seed, so that a spread over seeds covers how a hash of names happens to
    split the tasks, not one split."""
    return f"s{seed}-task{index}"


def coding_tasks(mix: TaskMix, params: CodingParams, seed: int) -> Trace:
    """``params.batch`` coding trajectories over ``mix``'s tasks; task ``k`` draws from seed ``seed * 1000 + k``."""
    trajectories = []
    batches = mix.batches(params.batch)
    for k, batch in enumerate(batches):
        if batch:
            trajectories += ai_coding(replace(params, batch=batch, task=task_name(k, seed)), seed * 1000 + k).trajectories
    return Trace("coding_tasks", seed, {"tasks": mix.tasks, "skew": mix.skew, "batches": batches,
                                        "coding": asdict(params)}, trajectories)
