"""What every scenario of ``tangram simulate`` shares (§6): the scale check, a run's points and outcome, running
a trace under the policies, a figure against the paper's, and the clusters the scenarios build (the paper's CPU
nodes and GPUs, MOPD's teachers, DeepSearch's judge and search upstreams).

Figures are ratios measured in the same run on the same trace (the baseline's mean ACT per trajectory over the
broker's), never absolute times against the paper's testbed. Kept apart from the scenarios so that each group of
them (``coding_scenarios``, ``gpu_scenarios``, ``slo_scenario``, ``e2e_scenarios``, ``sensitivity``) imports one
base and ``scenarios`` stays the registry.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tangram.sched.profile import SchedulerProfile
from tangram.sim.assumptions import Assumptions
from tangram.sim.cluster import ApiModel, Cluster, ServiceModel, gpu_nodes
from tangram.sim.engine import simulate
from tangram.sim.policies import named_policies
from tangram.sim.trace import Trace
from tangram.sim.workloads import teacher_names

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


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_policies(trace: Trace, cluster: Cluster, policies: tuple[str, ...], x: float, points: list[Point],
                 progress: Progress, label: str, profile: SchedulerProfile) -> None:
    """Simulate ``trace`` on ``cluster`` under each of ``policies``, the broker's under ``profile``."""
    named = named_policies(profile)
    for policy in policies:
        result = simulate(trace, cluster, named[policy], policy)
        summary = result.summary()
        points.append(Point(x, policy, summary))
        progress(f"{label} {policy:>9}: mean ACT per trajectory {summary['mean_trajectory_act_s']:9.2f} s, "
                 f"{summary['calls']} calls, {summary['wall_s']:.1f} s wall")


def figure(name: str, paper: float | str | None, ours: float, note: str = "") -> dict[str, Any]:
    ratio = ours / paper if isinstance(paper, (int, float)) and paper else None
    return {"name": name, "paper": paper, "ours": round(ours, 3), "ours_over_paper": None if ratio is None
            else round(ratio, 3), "note": note}


def cpu_cluster(cores: int, scale: float, assumed: Assumptions) -> Cluster:
    """``cores`` (already scaled) over the scale's share of the five nodes: as many cores per node as at full
    scale, and the pods' control plane binding as many pods per second per node."""
    nodes = round(CPU_NODES * scale)
    costs = assumed.costs()
    return Cluster(cpu_nodes=nodes, cores_per_node=cores // nodes,
                   costs=replace(costs, pod_bind_per_s=costs.pod_bind_per_s * scale))


def gpu_cluster(gpus: int, services: tuple[ServiceModel, ...], assumed: Assumptions,
                apis: tuple[ApiModel, ...] = ()) -> Cluster:
    """``gpus`` in nodes of eight, serving ``services`` (and calling ``apis``) under the assumed costs and static
    batching."""
    return Cluster(gpu_node_sizes=gpu_nodes(gpus), services=services, apis=apis, costs=assumed.costs(),
                   static=assumed.static())


def teachers(n: int) -> tuple[ServiceModel, ...]:
    return tuple(ServiceModel(name) for name in teacher_names(n))


def search_api(name: str) -> ApiModel:
    """A search or page-fetch upstream (assumed: 200 calls/s, 256 in flight), enforcing its own limits."""
    return ApiModel(name, quota=12_000, period_s=60.0, concurrency=256)


def search_apis(scale: float, assumed: Assumptions) -> tuple[ApiModel, ...]:
    apis = (assumed.api(search_api("api.search")), assumed.api(search_api("api.fetch")))
    return tuple(replace(api, quota=max(1, round(api.quota * scale)),
                         concurrency=max(1, round(api.concurrency * scale))) for api in apis)


JUDGE = ServiceModel("judge", static_replicas=5, static_dop=8, generates=True)  # §6.1: five replicas at TP 8

#: why MOPD runs at full size whatever ``--scale`` (it takes seconds)
MOPD_FULL_SCALE = ("MOPD at full scale whatever --scale: the static deployment (a teacher on four GPUs each) "
                   "cannot shrink")
