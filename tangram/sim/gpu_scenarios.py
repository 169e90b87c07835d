"""The GPU scenarios (§6.2 and issue 18): MOPD's reward services against a static deployment (Fig. 8b), and the
MOPD+DeepSearch mix on 40 GPUs over a disk tier, under setup-aware scheduling, and on mixed H100 and H20 nodes.
Each shares the GPU pool of the paper's five nodes; only the GPU manager's choices differ.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from managers.gpu.gpu_types import speed
from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.assumptions import Assumptions
from tangram.sim.broker_station import gpu_node_configs
from tangram.sim.cluster import Cluster
from tangram.sim.engine import simulate
from tangram.sim.placement import solve, trace_loads
from tangram.sim.policies import broker, named_policies
from tangram.sim.scenario_common import (
    GPUS,
    JUDGE,
    MOPD_FULL_SCALE,
    NONE_ASSUMED,
    Outcome,
    Point,
    Progress,
    figure,
    gpu_cluster,
    run_policies,
    search_apis,
    teachers,
    to_stderr,
)
from tangram.sim.trace import Trace
from tangram.sim.workloads import deepsearch, merged, mopd


def gpu_batch(_scale: float, seed: int, progress: Progress = to_stderr,
              assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Fig. 8(b) left: MOPD with ten teachers on 40 GPUs vs a static deployment of four GPUs each."""
    points: list[Point] = []
    cluster = gpu_cluster(GPUS, teachers(10), assumed)
    batches = [256, 512, 1024, 2048]
    for batch in batches:
        trace = mopd(assumed.mopd(batch=batch, teachers=10), seed)
        run_policies(trace, cluster, ("tangram", "baseline", "serverless"), batch, points, progress,
                     f"gpu batch {batch:5d}", profile)
    out = Outcome("gpu-batch", "MOPD, ten reward services: ACT vs batch size (Fig. 8b left)", "RL batch size",
                  points, [], [MOPD_FULL_SCALE])
    out.figures += [figure("static / broker ACT at batch 1,024", 3.4,
                           out.act("baseline", batches[2]) / out.act("tangram", batches[2])),
                    figure("static / broker ACT at batch 2,048", 18.1,
                           out.act("baseline", batches[3]) / out.act("tangram", batches[3])),
                    figure("ServerlessLLM-style / broker ACT at batch 1,024", 101.8,
                           out.act("serverless", batches[2]) / out.act("tangram", batches[2]),
                           "on demand at the static DoP, no elastic reallocation"),
                    figure("ServerlessLLM-style / broker ACT at batch 2,048", "fails (timeouts)",
                           out.act("serverless", batches[3]) / out.act("tangram", batches[3]),
                           "on demand at the static DoP, no elastic reallocation")]
    return out


def gpu_cost(_scale: float, seed: int, progress: Progress = to_stderr,
             assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Fig. 8(b) right: the fewest GPUs with which the broker matches the static deployment's ACT (ten services
    on four GPUs each = 40 GPUs), at batch 1,024."""
    points: list[Point] = []
    trace = mopd(assumed.mopd(batch=1024, teachers=10), seed)
    services = teachers(10)
    run_policies(trace, gpu_cluster(GPUS, services, assumed), ("baseline",), GPUS, points, progress,
                 f"gpu-cost {GPUS:3d} GPUs", profile)
    target = points[0].summary["mean_trajectory_act_s"]
    enough = GPUS
    for gpus in (4, 8, 12, 16, 20, 24, 32, 40):
        run_policies(trace, gpu_cluster(gpus, services, assumed), ("tangram",), gpus, points, progress,
                     f"gpu-cost {gpus:3d} GPUs", profile)
        if points[-1].summary["mean_trajectory_act_s"] <= target:
            enough = gpus
            break
    out = Outcome("gpu-cost", "MOPD, ten reward services: GPUs for the static deployment's ACT (Fig. 8b right)",
                  "GPUs", points, [], [MOPD_FULL_SCALE])
    out.figures.append(figure("broker's GPUs / static deployment's GPUs for the same ACT", 0.29, enough / GPUS,
                              f"{enough} of {GPUS} GPUs (searched in steps of 4)"))
    return out


def _mopd_and_search(batch: int, seed: int, assumed: Assumptions) -> Trace:
    """§6.1's mixed workload: MOPD and DeepSearch trajectories sharing one GPU pool."""
    return merged("mopd+deepsearch", mopd(assumed.mopd(batch=batch), seed), deepsearch(assumed.search(batch=batch),
                                                                                     seed))


def _mixed_gpus(assumed: Assumptions) -> Cluster:
    """Ten services on 40 GPUs: nine MOPD teachers and DeepSearch's judge (§6.1), with the search APIs."""
    return gpu_cluster(GPUS, (*teachers(9), replace(JUDGE, static_replicas=1, static_dop=4)), assumed,
                       search_apis(1.0, assumed))


def gpu_tiers(scale: float, seed: int, progress: Progress = to_stderr,
              assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Issue 18: host copies twice the size of host memory, spilled to a disk tier, with and without prefetch,
    against every copy in host memory; same trace, same 40 GPUs, FCFS."""
    points: list[Point] = []
    batches = [round(batch * scale) for batch in (512, 1024, 2048)]
    in_host = _mixed_gpus(assumed)
    copies_mb = sum(service.host_memory_mb for service in in_host.services)  # one shared copy each per node
    tiered = replace(in_host, gpu_host_memory_mb=copies_mb // 2, gpu_disk_tier=True)
    # labels: "tangram" is the broker over the disk tier, "all-in-host" today's behaviour with room for every copy
    runs = (("all-in-host", in_host, "tangram"), ("tangram", tiered, "tangram"),
            ("tangram-no-prefetch", tiered, "tangram-no-prefetch"))
    for batch in batches:
        trace = _mopd_and_search(batch, seed, assumed)
        for label, cluster, policy in runs:
            summary = simulate(trace, cluster, named_policies(profile)[policy], label).summary()
            points.append(Point(batch, label, summary))
            progress(f"gpu-tiers {batch:5d} {label:>19}: mean ACT per trajectory "
                     f"{summary['mean_trajectory_act_s']:9.2f} s, {summary['disk_loads']} disk loads, "
                     f"{summary['wall_s']:.1f} s wall")
    disk = f"disk tier read rate {assumed.costs().disk_gb_per_s} GB/s per node (assumed; --set costs.disk_gb_per_s=)"
    out = Outcome("gpu-tiers", f"MOPD+DeepSearch on 40 GPUs, host copies ({copies_mb:,} MiB per node) twice the "
                               f"host memory, over a disk tier", "RL batch size", points, [],
                  ["--scale scales the batches; the 40 GPUs stay", disk])
    for batch in batches:
        out.figures += [
            figure(f"tiers / all-in-host mean ACT at batch {batch:,}", 1.3,
                   out.act("tangram", batch) / out.act("all-in-host", batch), "target: at most 1.3"),
            figure(f"tiers without / with prefetch mean ACT at batch {batch:,}", None,
                   out.act("tangram-no-prefetch", batch) / out.act("tangram", batch))]
    return out


def gpu_hrrs(scale: float, seed: int, progress: Progress = to_stderr,
             assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Issue 18: setup-aware scheduling against FCFS on the MOPD+DeepSearch mix, same trace and cluster: the HRRS
    order (``tangram-hrrs``), the wait for a resident instance (``tangram-wait``), and both (``tangram-hrrs-wait``)."""
    points: list[Point] = []
    batches = [round(batch * scale) for batch in (512, 1024, 2048)]
    policies = ("tangram", "tangram-hrrs", "tangram-wait", "tangram-hrrs-wait")
    for batch in batches:
        run_policies(_mopd_and_search(batch, seed, assumed), _mixed_gpus(assumed), policies, batch, points, progress,
                     f"gpu-hrrs {batch:5d}", profile)
    out = Outcome("gpu-hrrs", "MOPD+DeepSearch on 40 GPUs: setup-aware order (HRRS) and placement vs FCFS",
                  "RL batch size", points, [], ["--scale scales the batches; the 40 GPUs stay"])

    def summary(policy: str, batch: int) -> dict[str, Any]:
        return next(p.summary for p in points if p.policy == policy and p.x == batch)

    def p99_wait(policy: str, batch: int) -> float:
        return float(summary(policy, batch)["by_kind"]["reward"]["p99_queue_s"])

    for batch in batches:
        fcfs = summary("tangram", batch)
        for policy in policies[1:]:
            out.figures += [
                figure(f"{policy} / FCFS restores at batch {batch:,}", 0.6,
                       summary(policy, batch)["restores"] / max(fcfs["restores"], 1),
                       "target: at most 0.6 (40% fewer)"),
                figure(f"FCFS / {policy} mean ACT per trajectory at batch {batch:,}", 1.0,
                       out.act("tangram", batch) / out.act(policy, batch), "target: above 1"),
                figure(f"{policy} / FCFS p99 reward wait at batch {batch:,}", 1.2,
                       p99_wait(policy, batch) / max(p99_wait("tangram", batch), 1e-9), "target: at most 1.2")]
    return out


#: the mixed cluster of ``gpu-hetero``: 40 GPUs as 8 + 8 + 4 of each type, half H100 and half H20 (GPUs, not nodes)
HETERO_NODES = (8, 8, 4, 8, 8, 4)
HETERO_TYPES = ("h100", "h100", "h100", "h20", "h20", "h20")
#: its policies: the type-blind broker (every service on every node, the fit blind to types); the typed fit alone
#: (each action where it is expected to end first; no placement), the stronger baseline; the GPU manager's own
#: placement, solved from the demand it measures as the run goes (``[gpu.placement] method = "ilp"``, the default on
#: a typed cluster); and the placement solved once from the trace's loads (an oracle), by the ILP and by the greedy
HETERO_POLICIES: dict[str, dict[str, Any]] = {
    "tangram": {},
    "tangram-typed": {"typed_fit": True},
    "tangram-live": {"typed_fit": True, "live_placement": "ilp"},
    "tangram-placed": {"typed_fit": True, "placement": "ilp"},
    "tangram-greedy": {"typed_fit": True, "placement": "greedy"},
}


def hetero_cluster(assumed: Assumptions) -> Cluster:
    """``gpu-hetero``'s 40 GPUs, half H100 and half H20, the H20's figures scaled by ``--set hetero.*``."""
    cluster = replace(_mixed_gpus(assumed), gpu_node_sizes=HETERO_NODES, gpu_node_types=HETERO_TYPES)
    scaled = assumed.hetero()
    h20 = cluster.gpu_types["h20"]
    h20 = replace(h20, tflops=h20.tflops * scaled.tflops_factor, hbm_gb_per_s=h20.hbm_gb_per_s * scaled.hbm_factor)
    return replace(cluster, gpu_types={**cluster.gpu_types, "h20": h20})


def gpu_hetero(scale: float, seed: int, progress: Progress = to_stderr,
               assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """Issue 18: the MOPD+DeepSearch mix on 40 GPUs, half H100 and half H20, under the ``HETERO_POLICIES``: a
    type-blind broker, the typed fit alone, the GPU manager's own placement from the demand it measures, and a
    placement (ILP, greedy; ``managers/gpu/placement.py``) from the trace's own loads (an oracle). Teachers only
    score (compute-bound: an H20 runs them at 15% of an H100's speed); the judge generates (memory-bound: 119%)."""
    points: list[Point] = []
    batches = [round(batch * scale) for batch in (512, 1024, 2048)]
    cluster = hetero_cluster(assumed)
    h20, h100 = cluster.gpu_types["h20"], cluster.gpu_types["h100"]
    blind_t: dict[int, float] = {}
    notes = ["--scale scales the batches; the 40 GPUs stay",
             f"GPU nodes {HETERO_NODES} of types {HETERO_TYPES}: 20 GPUs of each type, 80 GiB lent per GPU on both",
             (f"h20 speed over h100: {speed(h20, h100, 'compute'):.3f} compute-bound (teachers), "
              f"{speed(h20, h100, 'memory'):.3f} memory-bound (judge); restores at the same rate (PCIe 5 on both)"),
             ("loads are an oracle: each service's reward work in the whole trace over its span "
              "(tangram/sim/placement.py), known before the run starts")]
    for batch in batches:
        trace = _mopd_and_search(batch, seed, assumed)
        loads = trace_loads(trace)
        for label, options in HETERO_POLICIES.items():
            oracle = {"loads": loads} if "placement" in options else {}
            summary = simulate(trace, cluster, broker(profile, **options, **oracle), label).summary()
            points.append(Point(batch, label, summary))
            progress(f"gpu-hetero {batch:5d} {label:>14}: mean ACT per trajectory "
                     f"{summary['mean_trajectory_act_s']:9.2f} s, {summary['wall_s']:.1f} s wall")
            placed = summary.get("placement") or (summary.get("live_placement") or {}).get("last")
            if placed is not None:
                solves = summary["live_placement"]["solves"] if "live_placement" in summary else None
                notes.append(f"batch {batch:,} {label} placement (GPUs' worth per type"
                             f"{f'; the last of {solves} solves' if solves else ''}): " + "; ".join(
                                 f"{service} {groups}" for service, groups in placed["shares"].items()))
        blind_t[batch] = solve("type-blind", cluster, gpu_node_configs(cluster), loads).objective
    out = Outcome("gpu-hetero", "MOPD+DeepSearch on 20 H100 + 20 H20: type-aware placement vs type-blind",
                  "RL batch size", points, [], notes)

    def placement(policy: str, batch: int) -> dict[str, Any]:
        return next(p.summary["placement"] for p in points if p.policy == policy and p.x == batch)

    for batch in batches:
        out.figures += [
            figure(f"type-blind / live placement mean ACT per trajectory at batch {batch:,}", 1.3,
                   out.act("tangram", batch) / out.act("tangram-live", batch), "target: at least 1.3"),
            figure(f"typed fit / live placement mean ACT per trajectory at batch {batch:,}", None,
                   out.act("tangram-typed", batch) / out.act("tangram-live", batch),
                   "against the stronger baseline: the fit alone, aware of types"),
            figure(f"live / oracle ILP placement mean ACT per trajectory at batch {batch:,}", None,
                   out.act("tangram-live", batch) / out.act("tangram-placed", batch),
                   "what learning the loads online costs"),
            figure(f"type-blind / oracle ILP placement mean ACT per trajectory at batch {batch:,}", 1.3,
                   out.act("tangram", batch) / out.act("tangram-placed", batch), "target: at least 1.3"),
            figure(f"greedy / ILP placement mean ACT per trajectory at batch {batch:,}", None,
                   out.act("tangram-greedy", batch) / out.act("tangram-placed", batch)),
            figure(f"ILP solve seconds at batch {batch:,}", None, placement("tangram-placed", batch)["solve_s"],
                   placement("tangram-placed", batch)["fallback"] or ""),
            figure(f"placement objective t, ILP, at batch {batch:,}", None,
                   placement("tangram-placed", batch)["objective"], "the factor by which every load is served"),
            figure(f"placement objective t, greedy, at batch {batch:,}", None,
                   placement("tangram-greedy", batch)["objective"]),
            figure(f"placement objective t, type-blind, at batch {batch:,}", None, blind_t[batch],
                   "every service on every type (host memory allows it), each type's GPUs shared by load")]
    return out
