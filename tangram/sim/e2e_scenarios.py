"""The paper's whole-workload scenarios: a call's ACT split into execution, queueing and overhead (Table 1), the four
workloads against what users run today (Figs. 6-7), and RL training steps of each (the step duration, §6.2). They
span the CPU and the GPU clusters, so they sit apart from the coding and the GPU scenarios.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.assumptions import Assumptions
from tangram.sim.cluster import Cluster
from tangram.sim.policies import named_policies
from tangram.sim.scenario_common import (
    CPU_NODES,
    GPUS,
    JUDGE,
    MOPD_FULL_SCALE,
    NONE_ASSUMED,
    Outcome,
    Point,
    Progress,
    cpu_cluster,
    figure,
    gpu_cluster,
    run_policies,
    search_apis,
    teachers,
    to_stderr,
)
from tangram.sim.trace import Trace
from tangram.sim.training import train
from tangram.sim.workloads import ai_coding, deepsearch, merged, mopd


def breakdown(scale: float, seed: int, progress: Progress = to_stderr,
              assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Table 1: a call's ACT split into execution, queueing and system overhead under the broker."""
    points: list[Point] = []
    cpu = cpu_cluster(round(1280 * scale), scale, assumed)
    for batch in (1280, 1536):
        b = round(batch * scale)
        run_policies(ai_coding(assumed.coding(batch=b), seed), cpu, ("tangram",), b, points, progress, f"coding {b:5d}",
                     profile)
    gpu = gpu_cluster(GPUS, teachers(9), assumed)
    for batch in (2048, 3072):
        run_policies(mopd(assumed.mopd(batch=batch), seed), gpu, ("tangram",), batch, points, progress,
                     f"mopd {batch:5d}", profile)
    out = Outcome("breakdown", "ACT breakdown per call (Table 1)", "workload (batch)", points, [], [MOPD_FULL_SCALE])
    paper = {0: (0.975, 0.015, 0.024), 1: (1.206, 0.428, 0.036), 2: (0.621, 0.081, 0.201), 3: (0.705, 15.05, 0.240)}
    names = ("Coding (1280)", "Coding (1536)", "MOPD (2048)", "MOPD (3072)")
    for i, point in enumerate(points):
        s = point.summary
        for part, key, value in zip(("exec", "queue", "overhead"), ("mean_exec_s", "mean_queue_s", "mean_overhead_s"),
                                    paper[i]):
            out.figures.append(figure(f"{names[i]} {part} s", value, s[key]))
    return out


def e2e(scale: float, seed: int, progress: Progress = to_stderr,
        assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Figs. 6-7: the four workloads against what users run today, on the same resources."""
    points: list[Point] = []
    nodes = round(CPU_NODES * scale)  # DeepSearch's judge: one replica on each of the scale's GPU nodes
    runs = [
        (0, ai_coding(assumed.coding(batch=round(1280 * scale)), seed),
         cpu_cluster(round(1280 * scale), scale, assumed)),
        (1, mopd(assumed.mopd(batch=2048), seed),
         gpu_cluster(36, teachers(9), assumed)),  # §6.1: nine teachers x 4 GPUs
        (2, deepsearch(assumed.search(batch=round(2048 * scale)), seed),
         gpu_cluster(8 * nodes, (replace(JUDGE, static_replicas=nodes),), assumed, search_apis(scale, assumed))),
        (3, merged("mopd+deepsearch", mopd(assumed.mopd(batch=1024), seed),
                   deepsearch(assumed.search(batch=1024), seed)),
         gpu_cluster(GPUS, (*teachers(9), replace(JUDGE, static_replicas=1, static_dop=4)), assumed,
                     search_apis(1.0, assumed))),  # §6.1: ten services on four GPUs each
    ]
    labels = ("AI coding", "MOPD", "DeepSearch", "MOPD+DeepSearch")
    for x, trace, cluster in runs:
        run_policies(trace, cluster, ("tangram", "baseline"), x, points, progress, f"e2e {labels[x]:>15}", profile)
    out = Outcome("e2e", "End to end: the four workloads vs their baselines (Figs. 6-7)", "workload", points, [],
                  [*(f"x = {i}: {label}" for i, label in enumerate(labels)),
                   f"{MOPD_FULL_SCALE}; so does MOPD+DeepSearch"])
    for x, label in enumerate(labels):
        out.figures.append(figure(f"{label}: baseline / broker ACT per trajectory", 4.3 if x == 0 else None,
                                  out.act("baseline", x) / out.act("tangram", x)))
    coding = {p.policy: p.summary["by_kind"] for p in points if p.x == 0}
    out.figures += [
        figure("AI coding: environment interaction (tool calls) ACT, pods / broker", 9.0,
               coding["baseline"]["tool"]["mean_act_s"] / coding["tangram"]["tool"]["mean_act_s"]),
        figure("AI coding: reward (test run) ACT, pods / broker", 2.8,
               coding["baseline"]["test"]["mean_act_s"] / coding["tangram"]["test"]["mean_act_s"])]
    return out


#: the paper's step-duration speed-ups (§6.2): AI coding 1.4x, DeepSearch 1.5x, MOPD "relatively small"
STEP_SPEEDUPS: tuple[float | str, ...] = (1.4, "small", 1.5)


def training(scale: float, seed: int, progress: Progress = to_stderr,
             assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """The paper's step duration and Fig. 6: ``step.steps`` RL steps of each workload (a fresh batch per step,
    rollout then ``step.train_s`` of training) under the broker and the baseline of ``e2e``, with the mean ACT of
    the calls ending in each time window over the run."""
    nodes = round(CPU_NODES * scale)
    params = assumed.step()
    runs: list[tuple[str, Callable[[int], Trace], Cluster]] = [
        ("AI coding", lambda s: ai_coding(assumed.coding(batch=round(1280 * scale)), s),
         cpu_cluster(round(1280 * scale), scale, assumed)),
        ("MOPD", lambda s: mopd(assumed.mopd(batch=2048), s), gpu_cluster(36, teachers(9), assumed)),
        ("DeepSearch", lambda s: deepsearch(assumed.search(batch=round(2048 * scale)), s),
         gpu_cluster(8 * nodes, (replace(JUDGE, static_replicas=nodes),), assumed, search_apis(scale, assumed))),
    ]
    points: list[Point] = []
    series: dict[str, list[list[Any]]] = {}
    for x, (label, make, cluster) in enumerate(runs):
        for policy in ("tangram", "baseline"):
            run = train(make, cluster, named_policies(profile)[policy], policy, params, seed)
            summary = run.summary()
            points.append(Point(x, policy, summary))
            series[f"{label}/{policy}"] = [[round(t, 1), None if act is None else round(act, 4), n]
                                           for t, act, n in run.windows(params.window_s)]
            progress(f"training {label:>10} {policy:>8}: step {summary['mean_step_s']:8.1f} s "
                     f"(rollout {summary['mean_rollout_s']:.1f} s + training {params.train_s:g} s)")
    out = Outcome("training", f"RL training: step duration and ACT per {params.window_s:g} s window (Fig. 6)",
                  "workload", points, [],
                  [*(f"x = {i}: {label}" for i, (label, _, _) in enumerate(runs)),
                   (f"{params.steps} steps of rollout then {params.train_s:g} s of training (assumed); "
                    f"{MOPD_FULL_SCALE}")], series)
    for x, (label, _, _) in enumerate(runs):
        step = {p.policy: p.summary["mean_step_s"] for p in points if p.x == x}
        rollout = {p.policy: p.summary["mean_rollout_s"] for p in points if p.x == x}
        bound = next(p.summary["mean_critical_path_s"] for p in points if p.x == x)  # the same steps' traces
        out.figures += [figure(f"{label}: step duration, baseline / broker", STEP_SPEEDUPS[x],
                               step["baseline"] / step["tangram"]),
                        figure(f"{label}: rollout makespan, baseline / broker", None,
                               rollout["baseline"] / rollout["tangram"]),
                        figure(f"{label}: step duration, baseline / critical path", None,
                               step["baseline"] / (bound + params.train_s),
                               "the most any scheduler reaches: each trajectory's calls back to back, fastest"),
                        figure(f"{label}: rollout makespan, critical path / broker", None,
                               bound / rollout["tangram"])]
    return out
