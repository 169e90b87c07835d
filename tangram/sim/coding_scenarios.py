"""The AI coding scenarios on the paper's CPU nodes (§6.3): mean ACT per trajectory over RL batch size and CPU
capacity against pods (Fig. 8a), and elastic test runs against every fixed DoP (Fig. 9). One workload, one cluster:
what the CPU manager's scheduling wins.
"""

from __future__ import annotations

from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.assumptions import Assumptions
from tangram.sim.policies import FIXED_DOPS
from tangram.sim.scenario_common import (
    NONE_ASSUMED,
    Outcome,
    Point,
    Progress,
    cpu_cluster,
    figure,
    run_policies,
    to_stderr,
)
from tangram.sim.workloads import ai_coding

#: §6.3's RL batch sizes (Fig. 8a left, Fig. 9) and CPU capacities (Fig. 8a right), before ``--scale``
CODING_BATCHES = (128, 256, 512, 1024, 1280, 1536)
CODING_CAPACITIES = (768, 1024, 1280, 1536, 2048)


def coding_batch(scale: float, seed: int, progress: Progress = to_stderr,
                 assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Fig. 8(a) left: mean ACT per trajectory vs RL batch size, 1,280 cores, against pods."""
    points: list[Point] = []
    cluster = cpu_cluster(round(1280 * scale), scale, assumed)
    batches = [round(b * scale) for b in CODING_BATCHES]
    bounds: dict[int, float] = {}
    for batch in batches:
        trace = ai_coding(assumed.coding(batch=batch), seed)
        bounds[batch] = trace.unqueued_trajectory_act_s()
        run_policies(trace, cluster, ("tangram", "baseline", "pods-ideal"), batch, points, progress,
                     f"coding batch {batch:5d}", profile)
    out = Outcome("coding-batch", "AI coding: ACT vs batch size (Fig. 8a left)", "RL batch size", points, [], [])
    ratios = [out.act("baseline", b) / out.act("tangram", b) for b in batches]
    out.figures += [
        figure("pods / broker ACT, smallest batch", 3.1, ratios[0]),
        figure("pods / broker ACT, largest batch", 27.7, ratios[-1]),
        figure("broker ACT, largest / smallest batch", "< 2", out.act("tangram", batches[-1])
               / out.act("tangram", batches[0])),
        *(figure(f"pods-ideal / broker ACT, batch {b}", None, out.act("pods-ideal", b) / out.act("tangram", b),
                 "no control-plane cost: a win from scheduling") for b in batches),
        *(figure(f"pods-ideal / unqueued ACT, batch {b}", None, out.act("pods-ideal", b) / bounds[b],
                 "the most any scheduler reaches: every call at its fastest, none waiting") for b in batches),
    ]
    return out


def coding_capacity(scale: float, seed: int, progress: Progress = to_stderr,
                    assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Fig. 8(a) right: mean ACT per trajectory vs CPU cores at batch 1,280, against pods."""
    points: list[Point] = []
    batch = round(1280 * scale)
    trace = ai_coding(assumed.coding(batch=batch), seed)
    capacities = [round(c * scale) for c in CODING_CAPACITIES]
    for cores in capacities:
        run_policies(trace, cpu_cluster(cores, scale, assumed), ("tangram", "baseline", "pods-ideal"), cores, points,
                     progress, f"coding cores {cores:5d}", profile)
    out = Outcome("coding-capacity", "AI coding: ACT vs CPU capacity at batch 1,280 (Fig. 8a right)", "CPU cores",
                  points, [], [])
    ratios = [out.act("baseline", c) / out.act("tangram", c) for c in capacities]
    out.figures += [figure("pods / broker ACT, fewest cores (768)", 1.89, ratios[0]),
                    figure("pods / broker ACT, most of the paper's (4.33x at best)", 4.33, max(ratios)),
                    *(figure(f"pods-ideal / broker ACT, {c} cores", None,
                             out.act("pods-ideal", c) / out.act("tangram", c),
                             "no control-plane cost: a win from scheduling") for c in capacities)]
    return out


FIXED_DOP_POLICIES = tuple(f"dop{d}" for d in FIXED_DOPS)


def dop(scale: float, seed: int, progress: Progress = to_stderr,
        assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Fig. 9 and beyond: elastic (malleable) test runs against every fixed DoP 1-32, and the paper's moldable
    allocation, over batch size on 1,280 cores."""
    points: list[Point] = []
    cluster = cpu_cluster(round(1280 * scale), scale, assumed)
    batches = [round(b * scale) for b in CODING_BATCHES]
    for batch in batches:
        trace = ai_coding(assumed.coding(batch=batch), seed)
        run_policies(trace, cluster, ("tangram", *FIXED_DOP_POLICIES, "tangram-paper"), batch, points, progress,
                     f"dop batch {batch:5d}", profile)
    out = Outcome("dop", "AI coding: elastic vs every fixed DoP (Fig. 9)", "RL batch size", points, [], [])
    for batch in batches:
        best = min(FIXED_DOP_POLICIES, key=lambda policy: out.act(policy, batch))
        out.figures.append(figure(f"best fixed DoP / ours ACT, batch {batch}", None,
                                  out.act(best, batch) / out.act("tangram", batch), f"best fixed: {best}"))
    b256, b1280 = round(256 * scale), round(1280 * scale)
    tool_queue = next(p.summary["by_kind"]["tool"]["mean_queue_s"] for p in points
                      if p.policy == "tangram" and p.x == b1280)
    out.figures += [
        figure("tool-call mean queueing (s) at batch 1,280", 0.015, tool_queue, "paper Table 1"),
        figure("DoP 4 / elastic ACT at batch 256", 2.0, out.act("dop4", b256) / out.act("tangram", b256)),
        figure("DoP 16 / elastic ACT at batch 1,280", 3.0, out.act("dop16", b1280) / out.act("tangram", b1280)),
        figure("paper's moldable allocation / ours ACT at batch 1,280", None,
               out.act("tangram-paper", b1280) / out.act("tangram", b1280)),
    ]
    return out
