"""The SLO scenario (issue 18): RL tasks offered in turn to a shared pool of 40 GPUs, admitted by the service's own
planner (``tangram/slo/plan.py``), and their steps' slowdowns against a dedicated deployment per task. Apart from the
other GPU scenarios: it runs tasks of steps (``task_steps``), not one trace per policy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.assumptions import Assumptions
from tangram.sim.policies import broker
from tangram.sim.scenario_common import (
    GPUS,
    NONE_ASSUMED,
    Outcome,
    Point,
    Progress,
    figure,
    gpu_cluster,
    to_stderr,
)
from tangram.sim.slo_workload import slo_service, slo_tasks
from tangram.sim.task_steps import Attainment, SloTask, attainment, run_steps
from tangram.slo.plan import Pool, first_breach, predict, reservations


def _admitted(tasks: list[SloTask], pool: Pool, reserve: bool = True) -> list[SloTask]:
    """The tasks admitted one by one in arrival order: each if no task's SLO would break with it (the service's own
    planner, ``tangram/slo/plan.py``; ``reserve=False``: on the shared bound alone), refused otherwise, and the next
    one tried."""
    admitted: list[SloTask] = []
    for task in tasks:
        if first_breach({t.name: t.plan for t in (*admitted, task)}, pool, reserve) is None:
            admitted.append(task)
    return admitted


def gpu_slo(scale: float, seed: int, progress: Progress = to_stderr,
            assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Issue 18: SLO admission on a shared pool of 40 GPUs against a dedicated deployment per task. Tasks are
    offered in order; the planner admits those whose worst case keeps every admitted task within its SLO. The
    admitted tasks then run their steps together on the pool under the broker, and each alone on its dedicated
    GPUs under the broker, on the same calls; a step is within its SLO if pooled / dedicated is at most the SLO.
    The planner reserves GPUs for the tasks the shared bound cannot keep, and the pooled run puts their actions
    ahead as the broker does. Also: the planner fed each task's reward mean and deviation too (a phase at the 99.9th
    percentile of its work); the shared bound alone, without reservations (the planner before them); and
    ``slo.unchecked`` times as many tasks as the dedicated deployments hold, admitted unchecked: what the pool
    really holds."""
    params = assumed.slo()
    params = replace(params, batches=tuple(max(1, round(batch * scale)) for batch in params.batches))
    costs = assumed.costs()
    tasks = slo_tasks(params, seed)
    services = {task.name: slo_service(task) for task in tasks}
    # a restore's GPU-seconds: the whole copy over the host-to-GPU links (split over a chunk's GPUs), and freeing
    # a victim on each of them
    restore = {s.name: s.host_memory_mb / 1024 / costs.h2d_gb_per_s + max(s.dops) * costs.evict_s
               for s in services.values()}
    pool = Pool(GPUS, restore)
    mean_s, sd_s = params.reward_moments()
    stochastic = [replace(task, plan=replace(task.plan, action_mean_s=mean_s, action_sd_s=sd_s)) for task in tasks]
    dedicated: list[SloTask] = []  # each task on GPUs of its own, in arrival order, while GPUs are left
    for task in tasks:
        if sum(t.plan.dedicated_gpus for t in dedicated) + task.plan.dedicated_gpus <= GPUS:
            dedicated.append(task)
    chosen = {"worst-case": _admitted(tasks, pool), "stochastic": _admitted(stochastic, pool),
              "shared": _admitted(tasks, pool, reserve=False), "dedicated": dedicated,
              "unchecked": tasks[:params.unchecked * len(dedicated)]}
    reserving = ("worst-case", "stochastic")
    solo: dict[str, list[float]] = {}
    for task in {t.name: t for group in chosen.values() for t in group}.values():
        cluster = gpu_cluster(task.plan.dedicated_gpus, (services[task.name],), assumed)
        solo[task.name] = run_steps([task], cluster, broker(profile), "dedicated")[0][task.name]
    points: list[Point] = []
    for label, group in chosen.items():
        plans = {t.name: t.plan for t in group}
        stats: dict[str, Any] = {}
        reserved = reservations(plans, pool) if label in reserving else {}
        if label == "dedicated":
            pooled = solo
        else:  # the broker also estimates attainment itself, as it does for /metrics (``slo_attainment.py``)
            cluster = gpu_cluster(GPUS, tuple(services[t.name] for t in group), assumed)
            pooled, stats = run_steps(group, cluster, broker(profile, slo_plans=plans, reserved=reserved), label)
        met = [attainment(task, pooled[task.name], solo[task.name]) for task in group]
        summary = _slo_summary(label, met)
        summary["reserved_gpus"] = sum(reserved.values())
        if label != "dedicated":  # what the planner predicts for the set in the pool, on the plans it was given
            predicted = predict(plans, pool, reserve=label != "shared").values()
            summary["max_predicted_slowdown"] = max((p.slowdown for p in predicted), default=0.0)
            windows = stats["slo_windows"].values()
            summary["broker_windows"] = sum(w for w, _ in windows)
            summary["broker_attainment"] = sum(i for _, i in windows) / max(summary["broker_windows"], 1)
        points.append(Point(0, label, summary))
        progress(f"gpu-slo {label:>12}: {len(group)} tasks, attainment {points[-1].summary['attainment']:.3f}")
    out = Outcome("gpu-slo", f"RL tasks offered in turn ({params.candidates}) to {GPUS} shared GPUs: SLO admission "
                             f"against a dedicated deployment each", "-", points, [],
                  ["--scale scales each task's batch; the 40 GPUs stay",
                   (f"{params.steps} steps per task, all starting together; SLOs from Unif({params.slo_low:g}, "
                    f"{params.slo_high:g}) (RollMux §7.1); the workload is assumed (--set slo.*)"),
                   "x is meaningless here: one admission per policy"])
    by = {p.policy: p.summary for p in points}
    out.figures += [
        figure(f"tasks per {GPUS} GPUs: worst-case admission / dedicated", 1.84,
               by["worst-case"]["tasks"] / by["dedicated"]["tasks"], "paper: RollMux's cost efficiency"),
        figure("SLO attainment of the tasks admitted on the worst case (steps within)", 1.0,
               by["worst-case"]["attainment"], "target: 1"),
        figure("worst-case admission: the least attainment of one task", 1.0, by["worst-case"]["min_attainment"]),
        figure(f"GPUs reserved on the worst case (of {GPUS})", None, by["worst-case"]["reserved_gpus"]),
        figure(f"tasks per {GPUS} GPUs: worst-case admission on the shared bound alone / dedicated", None,
               by["shared"]["tasks"] / by["dedicated"]["tasks"], "the planner without reservations"),
        figure("SLO attainment of the tasks admitted on the shared bound alone", 1.0, by["shared"]["attainment"]),
        figure(f"tasks per {GPUS} GPUs: stochastic admission / dedicated", 1.84,
               by["stochastic"]["tasks"] / by["dedicated"]["tasks"], "phases at their 99.9th percentile"),
        figure("SLO attainment of the tasks admitted stochastically", 1.0, by["stochastic"]["attainment"],
               "target: 1"),
        figure("stochastic admission: the least attainment of one task", 1.0, by["stochastic"]["min_attainment"]),
        figure(f"SLO attainment of {params.unchecked}x the dedicated tasks, unchecked", None,
               by["unchecked"]["attainment"]),
        figure(f"{params.unchecked}x unchecked: the least attainment of one task", None,
               by["unchecked"]["min_attainment"]),
        *(figure(f"{label}: the broker's own attainment estimate (tangram/slo/attainment.py)", None,
                 by[label]["broker_attainment"], "from its reward phases alone, as /metrics gives it")
          for label in ("worst-case", "unchecked"))]
    return out


def _slo_summary(label: str, met: list[Attainment]) -> dict[str, Any]:
    slowdowns = sorted(s for a in met for s in a.slowdowns)
    return {"policy": label, "tasks": len(met), "steps": len(slowdowns),
            "attainment": sum(a.within for a in met) / max(len(slowdowns), 1),
            "min_attainment": min((a.fraction for a in met), default=1.0),
            "tasks_missing": sum(a.within < len(a.slowdowns) for a in met),
            "median_slowdown": slowdowns[len(slowdowns) // 2] if slowdowns else 0.0,
            "max_slowdown": slowdowns[-1] if slowdowns else 0.0}
