"""Past one broker (issue 40): the paper's AI coding load, split among RL tasks, on 1,280 cores through one broker
and through P = 2, 3, 4 broker partitions by task hash, each design of ``partitions``: static 1/P pools, a shared
view of free capacity, or a shared view that lends running test runs' cores across partitions. Its figures are
each design's mean ACT per trajectory, p99 ACT of a call and actions/s over one broker's, per setting (how many
tasks, how skewed their batches, how large the batch): the assumptions that decide them.
"""

from __future__ import annotations

from typing import Any

from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.assumptions import Assumptions
from tangram.sim.engine import Policy, simulate
from tangram.sim.partitions import partition_of, shared_partitions, static_partitions
from tangram.sim.policies import broker
from tangram.sim.scenario_common import NONE_ASSUMED, Outcome, Point, Progress, cpu_cluster, figure, to_stderr
from tangram.sim.task_mix import TaskMix, coding_tasks
from tangram.sim.trace import Trace

PARTITIONS = (2, 3, 4)
#: the task mixes compared, and the batch over the paper's 1,280 (assumed): few skewed tasks (a hash loads
#: partitions unevenly), some even ones, some skewed ones, many small even ones (the hash evens out), and the skewed
#: ones at twice the load (cores become scarce, so who may take them from whom matters)
SETTINGS = ((TaskMix(4, 1.0), 1), (TaskMix(16, 0.0), 1), (TaskMix(16, 1.0), 1), (TaskMix(64, 0.0), 1),
            (TaskMix(16, 1.0), 2))
ONE = "tangram"  # as every scenario names the broker
#: the assumptions every figure rests on
NOTES = ("the settings (task mixes, batch) are assumed",
         "tasks to partitions by a BLAKE2b hash of the task name; all tasks' rollouts start together (assumed)",
         "static P: cores_per_node // P cores of every node each (P = 3 leaves a core per node idle)",
         "shared P: passes in turn, the first mover rotating per instant; a partition resizes only its own actions",
         "lending P: shared P whose passes see every partition's running actions and resize them (cross-broker)")


def designs(profile: SchedulerProfile) -> dict[str, Policy]:
    """One broker, then each partitioned design at each P, by the name the figures give them."""
    return {ONE: broker(profile),
            **{f"static-{p}": static_partitions(profile, p) for p in PARTITIONS},
            **{f"shared-{p}": shared_partitions(profile, p) for p in PARTITIONS},
            **{f"lending-{p}": shared_partitions(profile, p, lend=True) for p in PARTITIONS}}


def imbalance(trace: Trace, partitions: int) -> float:
    """The busiest partition's trajectories over an even share (1: even; P: one partition has them all)."""
    counts = [0] * partitions
    for trajectory in trace.trajectories:
        counts[partition_of(trajectory.task, partitions)] += 1
    return max(counts) * partitions / max(1, len(trace.trajectories))


def throughput(summary: dict[str, Any]) -> float:
    """Actions per second over the rollout (calls over makespan)."""
    makespan: float = summary["makespan_s"]
    return summary["calls"] / makespan if makespan else 0.0


def partitions(scale: float, seed: int, progress: Progress = to_stderr,
               assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Every design in every setting, 1,280 cores and batch 1,280 (times the setting's load) before ``--scale``."""
    points: list[Point] = []
    cluster = cpu_cluster(round(1280 * scale), scale, assumed)
    labels = [f"{mix.label}, batch {1280 * load}" for mix, load in SETTINGS]
    out = Outcome("partitions", "Past one broker: partitions by task vs one broker (issue 40)",
                  "setting", points, [], [*(f"x = {x}: {label}" for x, label in enumerate(labels)), *NOTES])
    for x, ((mix, load), label) in enumerate(zip(SETTINGS, labels)):
        trace = coding_tasks(mix, assumed.coding(batch=round(1280 * load * scale)), seed)
        for name, policy in designs(profile).items():
            summary = simulate(trace, cluster, policy, name).summary()
            points.append(Point(x, name, summary))
            progress(f"{label:>30} {name:>10}: mean ACT per trajectory {summary['mean_trajectory_act_s']:7.2f} s, "
                     f"{summary['calls']} calls, {summary['wall_s']:.1f} s wall")
        one = next(p.summary for p in points if p.x == x and p.policy == ONE)
        out.figures += [figure(f"one broker: mean ACT per trajectory (s), {label}", None,
                               one["mean_trajectory_act_s"]),
                        figure(f"one broker: p99 ACT of a call (s), {label}", None, one["p99_act_s"]),
                        figure(f"one broker: actions/s, {label}", None, throughput(one))]
        for name in designs(profile):
            if name == ONE:
                continue
            run = next(p.summary for p in points if p.x == x and p.policy == name)
            out.figures += [
                figure(f"{name} / one broker: mean ACT per trajectory, {label}", None,
                       run["mean_trajectory_act_s"] / one["mean_trajectory_act_s"]),
                figure(f"{name} / one broker: p99 ACT of a call, {label}", None, run["p99_act_s"] / one["p99_act_s"]),
                figure(f"{name} / one broker: actions/s, {label}", None, throughput(run) / throughput(one))]
        out.figures += [figure(f"busiest partition / even share, P = {p}, {label}", None, imbalance(trace, p),
                               "trajectories by task hash") for p in PARTITIONS]
    return out
