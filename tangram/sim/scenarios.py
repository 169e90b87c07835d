"""The paper's evaluation as runnable scenarios (§6): each sweeps a workload over batch size or capacity under
the broker and its baselines, and reports the paper's figure, ours and their ratio.

Figures are ratios measured in the same run on the same trace (the baseline's mean ACT per trajectory over the
broker's), never absolute times against the paper's testbed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from managers.cpu.config import CpuConfig
from managers.gpu.gpu_types import speed
from tangram.sim.assumptions import Assumptions
from tangram.sim.broker_station import gpu_node_configs
from tangram.sim.cluster import ApiModel, Cluster, Costs, ServiceModel, gpu_nodes
from tangram.sim.engine import simulate
from tangram.sim.placement import solve, trace_loads
from tangram.sim.policies import FIXED_DOPS, POLICIES, broker
from tangram.sim.slo_workload import slo_service, slo_tasks
from tangram.sim.task_steps import Attainment, SloTask, attainment, run_steps
from tangram.sim.trace import Trace
from tangram.sim.training import train
from tangram.sim.workloads import (
    CodingParams,
    ai_coding,
    deepsearch,
    merged,
    mopd,
    teacher_names,
)
from tangram.slo.plan import Pool, first_breach, predict, reservations

CPU_NODES = 5  # §6.3: 1,280 cores over five nodes
GPUS = 40  # §6.1: five nodes of eight GPUs
NONE_ASSUMED = Assumptions()  # every parameter at its assumed value


def check_scale(scale: float) -> None:
    """``--scale`` multiplies batch sizes and capacity by removing whole nodes: the nodes keep the paper's
    density (256 cores; a fixed DoP of 32 and the pods' packing stay what they are at full scale), so only multiples
    of 1/5 keep the conclusions. Raises ValueError for any other scale."""
    nodes = scale * CPU_NODES
    if not math.isfinite(nodes) or nodes < 1 - 1e-9 or abs(nodes - round(nodes)) > 1e-9:
        raise ValueError(f"the scale must be a positive multiple of 1/{CPU_NODES} (whole nodes of the paper's "
                         f"density: 0.2, 0.4, ..., 1, 1.2, ...), got {scale}")


@dataclass(frozen=True)
class Point:
    """One simulated run: a workload at one setting under one policy."""

    x: float
    policy: str
    summary: dict[str, Any]


@dataclass
class Outcome:
    scenario: str
    title: str
    x_label: str
    points: list[Point]
    figures: list[dict[str, Any]]  # {"name", "paper", "ours", "ratio"}; paper/ours are numbers or text
    notes: list[str]
    #: time series by name, as [time, value or None, count] rows (the training scenario's ACT per window)
    series: dict[str, list[list[Any]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"scenario": self.scenario, "title": self.title, "x_label": self.x_label,
                                "figures": self.figures, "notes": self.notes,
                                "points": [{"x": p.x, "policy": p.policy, **p.summary} for p in self.points]}
        if self.series:
            body["series"] = self.series
        return body

    def act(self, policy: str, x: float) -> float:
        return next(p.summary["mean_trajectory_act_s"] for p in self.points if p.policy == policy and p.x == x)


Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(trace: Trace, cluster: Cluster, policies: tuple[str, ...], x: float, points: list[Point],
         progress: Progress, label: str) -> None:
    for policy in policies:
        result = simulate(trace, cluster, POLICIES[policy], policy)
        summary = result.summary()
        points.append(Point(x, policy, summary))
        progress(f"{label} {policy:>9}: mean ACT per trajectory {summary['mean_trajectory_act_s']:9.2f} s, "
                 f"{summary['calls']} calls, {summary['wall_s']:.1f} s wall")


def _figure(name: str, paper: float | str | None, ours: float, note: str = "") -> dict[str, Any]:
    ratio = ours / paper if isinstance(paper, (int, float)) and paper else None
    return {"name": name, "paper": paper, "ours": round(ours, 3), "ours_over_paper": None if ratio is None
            else round(ratio, 3), "note": note}


def _cpu(cores: int, scale: float, assumed: Assumptions) -> Cluster:
    """``cores`` (already scaled) over the scale's share of the five nodes: as many cores per node as at full
    scale, and the pods' control plane binding as many pods per second per node."""
    nodes = round(CPU_NODES * scale)
    costs = assumed.costs()
    return Cluster(cpu_nodes=nodes, cores_per_node=cores // nodes,
                   costs=replace(costs, pod_bind_per_s=costs.pod_bind_per_s * scale))


def _gpu(gpus: int, services: tuple[ServiceModel, ...], assumed: Assumptions,
         apis: tuple[ApiModel, ...] = ()) -> Cluster:
    """``gpus`` in nodes of eight, serving ``services`` (and calling ``apis``) under the assumed costs and static
    batching."""
    return Cluster(gpu_node_sizes=gpu_nodes(gpus), services=services, apis=apis, costs=assumed.costs(),
                   static=assumed.static())


def _teachers(n: int) -> tuple[ServiceModel, ...]:
    return tuple(ServiceModel(name) for name in teacher_names(n))


def search_api(name: str) -> ApiModel:
    """A search or page-fetch upstream (assumed: 200 calls/s, 256 in flight), enforcing its own limits."""
    return ApiModel(name, quota=12_000, period_s=60.0, concurrency=256)


def _search_apis(scale: float, assumed: Assumptions) -> tuple[ApiModel, ...]:
    apis = (assumed.api(search_api("api.search")), assumed.api(search_api("api.fetch")))
    return tuple(replace(api, quota=max(1, round(api.quota * scale)),
                         concurrency=max(1, round(api.concurrency * scale))) for api in apis)


#: §6.3's RL batch sizes (Fig. 8a left, Fig. 9) and CPU capacities (Fig. 8a right), before ``--scale``
CODING_BATCHES = (128, 256, 512, 1024, 1280, 1536)
CODING_CAPACITIES = (768, 1024, 1280, 1536, 2048)

JUDGE = ServiceModel("judge", static_replicas=5, static_dop=8, generates=True)  # §6.1: five replicas at TP 8


def coding_batch(scale: float, seed: int, progress: Progress = _stderr,
                 assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Fig. 8(a) left: mean ACT per trajectory vs RL batch size, 1,280 cores, against pods."""
    points: list[Point] = []
    cluster = _cpu(round(1280 * scale), scale, assumed)
    batches = [round(b * scale) for b in CODING_BATCHES]
    bounds: dict[int, float] = {}
    for batch in batches:
        trace = ai_coding(assumed.coding(batch=batch), seed)
        bounds[batch] = trace.unqueued_trajectory_act_s()
        _run(trace, cluster, ("tangram", "baseline", "pods-ideal"), batch, points, progress,
             f"coding batch {batch:5d}")
    out = Outcome("coding-batch", "AI coding: ACT vs batch size (Fig. 8a left)", "RL batch size", points, [], [])
    ratios = [out.act("baseline", b) / out.act("tangram", b) for b in batches]
    out.figures += [
        _figure("pods / broker ACT, smallest batch", 3.1, ratios[0]),
        _figure("pods / broker ACT, largest batch", 27.7, ratios[-1]),
        _figure("broker ACT, largest / smallest batch", "< 2", out.act("tangram", batches[-1])
                / out.act("tangram", batches[0])),
        *(_figure(f"pods-ideal / broker ACT, batch {b}", None, out.act("pods-ideal", b) / out.act("tangram", b),
                  "no control-plane cost: a win from scheduling") for b in batches),
        *(_figure(f"pods-ideal / unqueued ACT, batch {b}", None, out.act("pods-ideal", b) / bounds[b],
                  "the most any scheduler reaches: every call at its fastest, none waiting") for b in batches),
    ]
    return out


def coding_capacity(scale: float, seed: int, progress: Progress = _stderr,
                    assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Fig. 8(a) right: mean ACT per trajectory vs CPU cores at batch 1,280, against pods."""
    points: list[Point] = []
    batch = round(1280 * scale)
    trace = ai_coding(assumed.coding(batch=batch), seed)
    capacities = [round(c * scale) for c in CODING_CAPACITIES]
    for cores in capacities:
        _run(trace, _cpu(cores, scale, assumed), ("tangram", "baseline", "pods-ideal"), cores, points, progress,
             f"coding cores {cores:5d}")
    out = Outcome("coding-capacity", "AI coding: ACT vs CPU capacity at batch 1,280 (Fig. 8a right)", "CPU cores",
                  points, [], [])
    ratios = [out.act("baseline", c) / out.act("tangram", c) for c in capacities]
    out.figures += [_figure("pods / broker ACT, fewest cores (768)", 1.89, ratios[0]),
                    _figure("pods / broker ACT, most of the paper's (4.33x at best)", 4.33, max(ratios)),
                    *(_figure(f"pods-ideal / broker ACT, {c} cores", None,
                              out.act("pods-ideal", c) / out.act("tangram", c),
                              "no control-plane cost: a win from scheduling") for c in capacities)]
    return out


FIXED_DOP_POLICIES = tuple(f"dop{d}" for d in FIXED_DOPS)


def dop(scale: float, seed: int, progress: Progress = _stderr,
        assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Fig. 9 and beyond: elastic (malleable) test runs against every fixed DoP 1-32, and the paper's moldable
    allocation, over batch size on 1,280 cores."""
    points: list[Point] = []
    cluster = _cpu(round(1280 * scale), scale, assumed)
    batches = [round(b * scale) for b in CODING_BATCHES]
    for batch in batches:
        trace = ai_coding(assumed.coding(batch=batch), seed)
        _run(trace, cluster, ("tangram", *FIXED_DOP_POLICIES, "tangram-paper"), batch, points, progress,
             f"dop batch {batch:5d}")
    out = Outcome("dop", "AI coding: elastic vs every fixed DoP (Fig. 9)", "RL batch size", points, [], [])
    for batch in batches:
        best = min(FIXED_DOP_POLICIES, key=lambda policy: out.act(policy, batch))
        out.figures.append(_figure(f"best fixed DoP / ours ACT, batch {batch}", None,
                                   out.act(best, batch) / out.act("tangram", batch), f"best fixed: {best}"))
    b256, b1280 = round(256 * scale), round(1280 * scale)
    tool_queue = next(p.summary["by_kind"]["tool"]["mean_queue_s"] for p in points
                      if p.policy == "tangram" and p.x == b1280)
    out.figures += [
        _figure("tool-call mean queueing (s) at batch 1,280", 0.015, tool_queue, "paper Table 1"),
        _figure("DoP 4 / elastic ACT at batch 256", 2.0, out.act("dop4", b256) / out.act("tangram", b256)),
        _figure("DoP 16 / elastic ACT at batch 1,280", 3.0, out.act("dop16", b1280) / out.act("tangram", b1280)),
        _figure("paper's moldable allocation / ours ACT at batch 1,280", None,
                out.act("tangram-paper", b1280) / out.act("tangram", b1280)),
    ]
    return out


#: why MOPD runs at full size whatever ``--scale`` (it takes seconds)
MOPD_FULL_SCALE = "MOPD at full scale whatever --scale: the static deployment (a teacher on four GPUs each) cannot shrink"


def gpu_batch(_scale: float, seed: int, progress: Progress = _stderr,
              assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Fig. 8(b) left: MOPD with ten teachers on 40 GPUs vs a static deployment of four GPUs each."""
    points: list[Point] = []
    cluster = _gpu(GPUS, _teachers(10), assumed)
    batches = [256, 512, 1024, 2048]
    for batch in batches:
        trace = mopd(assumed.mopd(batch=batch, teachers=10), seed)
        _run(trace, cluster, ("tangram", "baseline", "serverless"), batch, points, progress, f"gpu batch {batch:5d}")
    out = Outcome("gpu-batch", "MOPD, ten reward services: ACT vs batch size (Fig. 8b left)", "RL batch size",
                  points, [], [MOPD_FULL_SCALE])
    out.figures += [_figure("static / broker ACT at batch 1,024", 3.4,
                            out.act("baseline", batches[2]) / out.act("tangram", batches[2])),
                    _figure("static / broker ACT at batch 2,048", 18.1,
                            out.act("baseline", batches[3]) / out.act("tangram", batches[3])),
                    _figure("ServerlessLLM-style / broker ACT at batch 1,024", 101.8,
                            out.act("serverless", batches[2]) / out.act("tangram", batches[2]),
                            "on demand at the static DoP, no elastic reallocation"),
                    _figure("ServerlessLLM-style / broker ACT at batch 2,048", "fails (timeouts)",
                            out.act("serverless", batches[3]) / out.act("tangram", batches[3]),
                            "on demand at the static DoP, no elastic reallocation")]
    return out


def gpu_cost(_scale: float, seed: int, progress: Progress = _stderr,
             assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Fig. 8(b) right: the fewest GPUs with which the broker matches the static deployment's ACT (ten services
    on four GPUs each = 40 GPUs), at batch 1,024."""
    points: list[Point] = []
    trace = mopd(assumed.mopd(batch=1024, teachers=10), seed)
    services = _teachers(10)
    _run(trace, _gpu(GPUS, services, assumed), ("baseline",), GPUS, points, progress, f"gpu-cost {GPUS:3d} GPUs")
    target = points[0].summary["mean_trajectory_act_s"]
    enough = GPUS
    for gpus in (4, 8, 12, 16, 20, 24, 32, 40):
        _run(trace, _gpu(gpus, services, assumed), ("tangram",), gpus, points, progress, f"gpu-cost {gpus:3d} GPUs")
        if points[-1].summary["mean_trajectory_act_s"] <= target:
            enough = gpus
            break
    out = Outcome("gpu-cost", "MOPD, ten reward services: GPUs for the static deployment's ACT (Fig. 8b right)",
                  "GPUs", points, [], [MOPD_FULL_SCALE])
    out.figures.append(_figure("broker's GPUs / static deployment's GPUs for the same ACT", 0.29, enough / GPUS,
                               f"{enough} of {GPUS} GPUs (searched in steps of 4)"))
    return out


def _mopd_and_search(batch: int, seed: int, assumed: Assumptions) -> Trace:
    """§6.1's mixed workload: MOPD and DeepSearch trajectories sharing one GPU pool."""
    return merged("mopd+deepsearch", mopd(assumed.mopd(batch=batch), seed), deepsearch(assumed.search(batch=batch),
                                                                                     seed))


def _mixed_gpus(assumed: Assumptions) -> Cluster:
    """Ten services on 40 GPUs: nine MOPD teachers and DeepSearch's judge (§6.1), with the search APIs."""
    return _gpu(GPUS, (*_teachers(9), replace(JUDGE, static_replicas=1, static_dop=4)), assumed,
                _search_apis(1.0, assumed))


def gpu_tiers(scale: float, seed: int, progress: Progress = _stderr,
              assumed: Assumptions = NONE_ASSUMED) -> Outcome:
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
            summary = simulate(trace, cluster, POLICIES[policy], label).summary()
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
            _figure(f"tiers / all-in-host mean ACT at batch {batch:,}", 1.3,
                    out.act("tangram", batch) / out.act("all-in-host", batch), "target: at most 1.3"),
            _figure(f"tiers without / with prefetch mean ACT at batch {batch:,}", None,
                    out.act("tangram-no-prefetch", batch) / out.act("tangram", batch))]
    return out


def gpu_hrrs(scale: float, seed: int, progress: Progress = _stderr,
             assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Issue 18: setup-aware scheduling against FCFS on the MOPD+DeepSearch mix, same trace and cluster: the HRRS
    order (``tangram-hrrs``), the wait for a resident instance (``tangram-wait``), and both (``tangram-hrrs-wait``)."""
    points: list[Point] = []
    batches = [round(batch * scale) for batch in (512, 1024, 2048)]
    policies = ("tangram", "tangram-hrrs", "tangram-wait", "tangram-hrrs-wait")
    for batch in batches:
        _run(_mopd_and_search(batch, seed, assumed), _mixed_gpus(assumed), policies, batch, points, progress,
             f"gpu-hrrs {batch:5d}")
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
                _figure(f"{policy} / FCFS restores at batch {batch:,}", 0.6,
                        summary(policy, batch)["restores"] / max(fcfs["restores"], 1),
                        "target: at most 0.6 (40% fewer)"),
                _figure(f"FCFS / {policy} mean ACT per trajectory at batch {batch:,}", 1.0,
                        out.act("tangram", batch) / out.act(policy, batch), "target: above 1"),
                _figure(f"{policy} / FCFS p99 reward wait at batch {batch:,}", 1.2,
                        p99_wait(policy, batch) / max(p99_wait("tangram", batch), 1e-9), "target: at most 1.2")]
    return out


#: the mixed cluster of ``gpu-hetero``: 40 GPUs as 8 + 8 + 4 of each type, half H100 and half H20 (GPUs, not nodes)
HETERO_NODES = (8, 8, 4, 8, 8, 4)
HETERO_TYPES = ("h100", "h100", "h100", "h20", "h20", "h20")
#: its policies: the type-blind broker (every service on every node, the fit blind to types); the typed fit alone
#: (each action where it is expected to end first; no placement), the stronger baseline; the GPU manager's own
#: placement, solved from the demand it measures as the run goes (``[gpu] placement = "ilp"``, the default on a
#: typed cluster); and the placement solved once from the trace's loads (an oracle), by the ILP and by the greedy
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


def gpu_hetero(scale: float, seed: int, progress: Progress = _stderr,
               assumed: Assumptions = NONE_ASSUMED) -> Outcome:
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
            summary = simulate(trace, cluster, broker(**options, **oracle), label).summary()
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
            _figure(f"type-blind / live placement mean ACT per trajectory at batch {batch:,}", 1.3,
                    out.act("tangram", batch) / out.act("tangram-live", batch), "target: at least 1.3"),
            _figure(f"typed fit / live placement mean ACT per trajectory at batch {batch:,}", None,
                    out.act("tangram-typed", batch) / out.act("tangram-live", batch),
                    "against the stronger baseline: the fit alone, aware of types"),
            _figure(f"live / oracle ILP placement mean ACT per trajectory at batch {batch:,}", None,
                    out.act("tangram-live", batch) / out.act("tangram-placed", batch),
                    "what learning the loads online costs"),
            _figure(f"type-blind / oracle ILP placement mean ACT per trajectory at batch {batch:,}", 1.3,
                    out.act("tangram", batch) / out.act("tangram-placed", batch), "target: at least 1.3"),
            _figure(f"greedy / ILP placement mean ACT per trajectory at batch {batch:,}", None,
                    out.act("tangram-greedy", batch) / out.act("tangram-placed", batch)),
            _figure(f"ILP solve seconds at batch {batch:,}", None, placement("tangram-placed", batch)["solve_s"],
                    placement("tangram-placed", batch)["fallback"] or ""),
            _figure(f"placement objective t, ILP, at batch {batch:,}", None,
                    placement("tangram-placed", batch)["objective"], "the factor by which every load is served"),
            _figure(f"placement objective t, greedy, at batch {batch:,}", None,
                    placement("tangram-greedy", batch)["objective"]),
            _figure(f"placement objective t, type-blind, at batch {batch:,}", None, blind_t[batch],
                    "every service on every type (host memory allows it), each type's GPUs shared by load")]
    return out


def _admitted(tasks: list[SloTask], pool: Pool, reserve: bool = True) -> list[SloTask]:
    """The tasks admitted one by one in arrival order: each if no task's SLO would break with it (the service's own
    planner, ``tangram/slo/plan.py``; ``reserve=False``: on the shared bound alone), refused otherwise, and the next
    one tried."""
    admitted: list[SloTask] = []
    for task in tasks:
        if first_breach({t.name: t.plan for t in (*admitted, task)}, pool, reserve) is None:
            admitted.append(task)
    return admitted


def gpu_slo(scale: float, seed: int, progress: Progress = _stderr,
            assumed: Assumptions = NONE_ASSUMED) -> Outcome:
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
        cluster = _gpu(task.plan.dedicated_gpus, (services[task.name],), assumed)
        solo[task.name] = run_steps([task], cluster, POLICIES["tangram"], "dedicated")[0][task.name]
    points: list[Point] = []
    for label, group in chosen.items():
        plans = {t.name: t.plan for t in group}
        stats: dict[str, Any] = {}
        reserved = reservations(plans, pool) if label in reserving else {}
        if label == "dedicated":
            pooled = solo
        else:  # the broker also estimates attainment itself, as it does for /metrics (``slo_attainment.py``)
            cluster = _gpu(GPUS, tuple(services[t.name] for t in group), assumed)
            pooled, stats = run_steps(group, cluster, broker(slo_plans=plans, reserved=reserved), label)
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
        _figure(f"tasks per {GPUS} GPUs: worst-case admission / dedicated", 1.84,
                by["worst-case"]["tasks"] / by["dedicated"]["tasks"], "paper: RollMux's cost efficiency"),
        _figure("SLO attainment of the tasks admitted on the worst case (steps within)", 1.0,
                by["worst-case"]["attainment"], "target: 1"),
        _figure("worst-case admission: the least attainment of one task", 1.0, by["worst-case"]["min_attainment"]),
        _figure(f"GPUs reserved on the worst case (of {GPUS})", None, by["worst-case"]["reserved_gpus"]),
        _figure(f"tasks per {GPUS} GPUs: worst-case admission on the shared bound alone / dedicated", None,
                by["shared"]["tasks"] / by["dedicated"]["tasks"], "the planner without reservations"),
        _figure("SLO attainment of the tasks admitted on the shared bound alone", 1.0, by["shared"]["attainment"]),
        _figure(f"tasks per {GPUS} GPUs: stochastic admission / dedicated", 1.84,
                by["stochastic"]["tasks"] / by["dedicated"]["tasks"], "phases at their 99.9th percentile"),
        _figure("SLO attainment of the tasks admitted stochastically", 1.0, by["stochastic"]["attainment"],
                "target: 1"),
        _figure("stochastic admission: the least attainment of one task", 1.0, by["stochastic"]["min_attainment"]),
        _figure(f"SLO attainment of {params.unchecked}x the dedicated tasks, unchecked", None,
                by["unchecked"]["attainment"]),
        _figure(f"{params.unchecked}x unchecked: the least attainment of one task", None,
                by["unchecked"]["min_attainment"]),
        *(_figure(f"{label}: the broker's own attainment estimate (tangram/slo/attainment.py)", None,
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


def breakdown(scale: float, seed: int, progress: Progress = _stderr,
              assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Table 1: a call's ACT split into execution, queueing and system overhead under the broker."""
    points: list[Point] = []
    cpu = _cpu(round(1280 * scale), scale, assumed)
    for batch in (1280, 1536):
        b = round(batch * scale)
        _run(ai_coding(assumed.coding(batch=b), seed), cpu, ("tangram",), b, points, progress, f"coding {b:5d}")
    gpu = _gpu(GPUS, _teachers(9), assumed)
    for batch in (2048, 3072):
        _run(mopd(assumed.mopd(batch=batch), seed), gpu, ("tangram",), batch, points, progress, f"mopd {batch:5d}")
    out = Outcome("breakdown", "ACT breakdown per call (Table 1)", "workload (batch)", points, [], [MOPD_FULL_SCALE])
    paper = {0: (0.975, 0.015, 0.024), 1: (1.206, 0.428, 0.036), 2: (0.621, 0.081, 0.201), 3: (0.705, 15.05, 0.240)}
    names = ("Coding (1280)", "Coding (1536)", "MOPD (2048)", "MOPD (3072)")
    for i, point in enumerate(points):
        s = point.summary
        for part, key, value in zip(("exec", "queue", "overhead"), ("mean_exec_s", "mean_queue_s", "mean_overhead_s"),
                                    paper[i]):
            out.figures.append(_figure(f"{names[i]} {part} s", value, s[key]))
    return out


def e2e(scale: float, seed: int, progress: Progress = _stderr,
        assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """Figs. 6-7: the four workloads against what users run today, on the same resources."""
    points: list[Point] = []
    nodes = round(CPU_NODES * scale)  # DeepSearch's judge: one replica on each of the scale's GPU nodes
    runs = [
        (0, ai_coding(assumed.coding(batch=round(1280 * scale)), seed), _cpu(round(1280 * scale), scale, assumed)),
        (1, mopd(assumed.mopd(batch=2048), seed),
         _gpu(36, _teachers(9), assumed)),  # §6.1: nine teachers x 4 GPUs
        (2, deepsearch(assumed.search(batch=round(2048 * scale)), seed),
         _gpu(8 * nodes, (replace(JUDGE, static_replicas=nodes),), assumed, _search_apis(scale, assumed))),
        (3, merged("mopd+deepsearch", mopd(assumed.mopd(batch=1024), seed),
                   deepsearch(assumed.search(batch=1024), seed)),
         _gpu(GPUS, (*_teachers(9), replace(JUDGE, static_replicas=1, static_dop=4)), assumed,
              _search_apis(1.0, assumed))),  # §6.1: ten services on four GPUs each
    ]
    labels = ("AI coding", "MOPD", "DeepSearch", "MOPD+DeepSearch")
    for x, trace, cluster in runs:
        _run(trace, cluster, ("tangram", "baseline"), x, points, progress, f"e2e {labels[x]:>15}")
    out = Outcome("e2e", "End to end: the four workloads vs their baselines (Figs. 6-7)", "workload", points, [],
                  [*(f"x = {i}: {label}" for i, label in enumerate(labels)),
                   f"{MOPD_FULL_SCALE}; so does MOPD+DeepSearch"])
    for x, label in enumerate(labels):
        out.figures.append(_figure(f"{label}: baseline / broker ACT per trajectory", 4.3 if x == 0 else None,
                                   out.act("baseline", x) / out.act("tangram", x)))
    coding = {p.policy: p.summary["by_kind"] for p in points if p.x == 0}
    out.figures += [
        _figure("AI coding: environment interaction (tool calls) ACT, pods / broker", 9.0,
                coding["baseline"]["tool"]["mean_act_s"] / coding["tangram"]["tool"]["mean_act_s"]),
        _figure("AI coding: reward (test run) ACT, pods / broker", 2.8,
                coding["baseline"]["test"]["mean_act_s"] / coding["tangram"]["test"]["mean_act_s"])]
    return out


#: the paper's step-duration speed-ups (§6.2): AI coding 1.4x, DeepSearch 1.5x, MOPD "relatively small"
STEP_SPEEDUPS: tuple[float | str, ...] = (1.4, "small", 1.5)


def training(scale: float, seed: int, progress: Progress = _stderr,
             assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """The paper's step duration and Fig. 6: ``step.steps`` RL steps of each workload (a fresh batch per step,
    rollout then ``step.train_s`` of training) under the broker and the baseline of ``e2e``, with the mean ACT of
    the calls ending in each time window over the run."""
    nodes = round(CPU_NODES * scale)
    params = assumed.step()
    runs: list[tuple[str, Callable[[int], Trace], Cluster]] = [
        ("AI coding", lambda s: ai_coding(assumed.coding(batch=round(1280 * scale)), s),
         _cpu(round(1280 * scale), scale, assumed)),
        ("MOPD", lambda s: mopd(assumed.mopd(batch=2048), s), _gpu(36, _teachers(9), assumed)),
        ("DeepSearch", lambda s: deepsearch(assumed.search(batch=round(2048 * scale)), s),
         _gpu(8 * nodes, (replace(JUDGE, static_replicas=nodes),), assumed, _search_apis(scale, assumed))),
    ]
    points: list[Point] = []
    series: dict[str, list[list[Any]]] = {}
    for x, (label, make, cluster) in enumerate(runs):
        for policy in ("tangram", "baseline"):
            run = train(make, cluster, POLICIES[policy], policy, params, seed)
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
        out.figures += [_figure(f"{label}: step duration, baseline / broker", STEP_SPEEDUPS[x],
                                step["baseline"] / step["tangram"]),
                        _figure(f"{label}: rollout makespan, baseline / broker", None,
                                rollout["baseline"] / rollout["tangram"]),
                        _figure(f"{label}: step duration, baseline / critical path", None,
                                step["baseline"] / (bound + params.train_s),
                                "the most any scheduler reaches: each trajectory's calls back to back, fastest"),
                        _figure(f"{label}: rollout makespan, critical path / broker", None,
                                bound / rollout["tangram"])]
    return out


Variation = tuple[str, str, dict[str, Any], dict[str, Any], float | None]

#: the values tried for each assumption, defaults among them: (name, value label, workload params, costs, the CPU
#: manager's worker overhead share)
TRIED: tuple[Variation, ...] = (
    *(("test runner", runner, {}, {"test_runner": runner}, None) for runner in ("tangram", "xdist")),
    *(("runner cost, share of the suite", f"{x:.0%}", {}, {"runner_share": x}, None) for x in (0.0, 0.03, 0.12)),
    # under xdist: each worker collects the suite (the five measured suites' least and most; their median is the
    # "test runner = xdist" row), and the model before that calibration
    *(("xdist start-up per worker, share of the suite", f"{x:.1%}", {},
       {"test_runner": "xdist", "xdist_worker_share": x}, None) for x in (0.012, 0.27)),
    ("test-run model", "xdist before calibration (0.05 s + 0.22 s per worker)", {},
     {"test_runner": "xdist", "xdist_start_cpu_s": 0.05, "xdist_worker_cpu_s": 0.22, "xdist_worker_share": 0.0},
     None),
    *(("sandbox creation", f"{s:.1f} s", {}, {"env_create_s": s}, None) for s in (0.4, 1.0, 2.0)),
    *(("test-run serial fraction", f"{low:.0%}-{high:.0%}", {"serial_low": low, "serial_high": high}, {}, None)
      for low, high in ((0.0, 0.02), (0.01, 0.10), (0.05, 0.25))),
    *(("profiled T1 error (sigma)", f"{e:g}", {"profile_error": e}, {}, None) for e in (0.0, 0.25, 0.5)),
    *(("test-run T1 median", f"{t:g} s", {"test_median_s": t}, {}, None) for t in (5.0, 20.0, 60.0)),
    # how many xdist workers a malleable run starts beyond its cores (the runner's follow its cores instead)
    *(("xdist workers' start-up share", f"{x:.0%}", {}, {"test_runner": "xdist"}, x) for x in (0.02, 0.05, 0.1, 0.2)),
)


def _is_default(variation: Variation) -> bool:
    """Whether a tried value is what the simulator assumes now: then it is the defaults row, not a variation."""
    _, _, params, costs, overhead = variation
    return (all(getattr(CodingParams(), k) == v for k, v in params.items())
            and all(getattr(Costs(), k) == v for k, v in costs.items())
            and overhead in (None, CpuConfig.worker_overhead))


#: one assumption varied at a time from its default (the defaults' own values are the defaults row, whatever the
#: defaults are now)
VARIATIONS: tuple[Variation, ...] = tuple(v for v in TRIED if not _is_default(v))
#: the fixed DoPs the sensitivity scenario compares with (DoP 1 and 32 are never best at batch 1,280)
SENSITIVITY_DOPS = ("dop2", "dop4", "dop8", "dop16")


def sensitivity(scale: float, seed: int, progress: Progress = _stderr,
                assumed: Assumptions = NONE_ASSUMED) -> Outcome:
    """AI coding at batch 1,280 on 1,280 cores with one assumption varied at a time: best fixed DoP / ours and
    pods-ideal / ours, so a headline figure comes with how the assumptions that decide it move it."""
    points: list[Point] = []
    out = Outcome("sensitivity", "AI coding at batch 1,280: the margins under varied assumptions",
                  "assumption varied (one at a time)", points, [],
                  [f"best fixed DoP among {', '.join(SENSITIVITY_DOPS)}",
                   *(f"default {v[0]}: {v[1]}" for v in TRIED if _is_default(v))])
    batch = round(1280 * scale)
    for index, (name, label, params, costs, overhead) in enumerate((("defaults", "-", {}, {}, None), *VARIATIONS)):
        out.notes.append(f"x = {index}: {name} = {label}")
        cluster = _cpu(round(1280 * scale), scale, assumed)
        cluster = replace(cluster, costs=replace(cluster.costs, **costs))
        trace = ai_coding(assumed.coding(batch=batch, **params), seed)
        ours = POLICIES["tangram"] if overhead is None else broker(worker_overhead=overhead)
        summary = simulate(trace, cluster, ours, "tangram").summary()
        points.append(Point(index, "tangram", summary))
        progress(f"sensitivity {name} {label}: ours {summary['mean_trajectory_act_s']:.2f} s")
        _run(trace, cluster, (*SENSITIVITY_DOPS, "pods-ideal"), index, points, progress, f"sensitivity {index:2d}")
        best = min(SENSITIVITY_DOPS, key=lambda policy: out.act(policy, index))
        out.figures += [
            _figure(f"{name} = {label}: best fixed DoP / ours", None, out.act(best, index) / out.act("tangram", index),
                    f"best fixed: {best}"),
            _figure(f"{name} = {label}: pods-ideal / ours", None,
                    out.act("pods-ideal", index) / out.act("tangram", index))]
    return out


SCENARIOS: dict[str, Callable[..., Outcome]] = {
    "coding-batch": coding_batch, "coding-capacity": coding_capacity, "dop": dop, "gpu-batch": gpu_batch,
    "gpu-cost": gpu_cost, "gpu-hrrs": gpu_hrrs, "gpu-tiers": gpu_tiers, "gpu-slo": gpu_slo, "gpu-hetero": gpu_hetero,
    "breakdown": breakdown, "e2e": e2e, "training": training, "sensitivity": sensitivity}
