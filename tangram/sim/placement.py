"""Which GPU nodes each reward service may run on in a simulated run on a typed cluster (issue 18): the placement
of ``managers/gpu/placement.py`` over the cluster's node groups, from loads that the scenario reads off the trace,
given to the GPU manager as the groups where each service has a variant (``GpuManager.place_on_types``).

The loads are an oracle: the whole trace's reward work is known before the run starts, which a broker never knows.
It measures what a placement is worth with its input right, against the manager's own placement from the demand it
measures (``[gpu.placement]``, ``managers/gpu/live_placement.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from managers.gpu.config import GpuNodeConfig
from managers.gpu.gpu_types import REFERENCE_TYPE
from managers.gpu.placement import Method, Placement, place, place_greedy, place_type_blind
from managers.gpu.placement_problem import ServiceLoad, node_groups
from tangram.sim.cluster import Cluster
from tangram.sim.trace import Trace


def trace_loads(trace: Trace) -> dict[str, float]:
    """Each reward service's load in GPU-seconds per second on the reference type: the trace's reward work for it
    (one-GPU durations) over the trace's span, the latest end of a trajectory that never waits (its start, then
    its think and work times). Only the loads' ratios steer the placement; the span sets the scale of ``t``."""
    work: dict[str, float] = {}
    span = 0.0
    for trajectory in trace.trajectories:
        span = max(span, trajectory.start_s + sum(call.think_s + call.work_s for call in trajectory.calls))
        for call in trajectory.calls:
            if call.kind == "reward" and call.target is not None:
                work[call.target] = work.get(call.target, 0.0) + call.work_s
    return {service: seconds / span for service, seconds in work.items()} if span > 0 else {}


def solve(method: Method, cluster: Cluster, nodes: Iterable[GpuNodeConfig], loads: Mapping[str, float]) -> Placement:
    """The placement ``method`` finds for the cluster's services under ``loads`` (a service absent: no load)."""
    services = [ServiceLoad(s.name, loads.get(s.name, 0.0), s.host_memory_mb, s.gpu_memory_mb, s.bound)
                for s in cluster.services]
    groups = node_groups(nodes, cluster.gpu_types)
    reference = cluster.gpu_types[REFERENCE_TYPE]
    if method == "ilp":
        return place(services, groups, reference)
    if method == "greedy":
        return place_greedy(services, groups, reference)
    return place_type_blind(services, groups, reference)


def placement_stats(placement: Placement) -> dict[str, Any]:
    """What a run reports of its placement (``t`` as None when no service has load)."""
    return {"method": placement.method, "objective": placement.objective if math.isfinite(placement.objective)
            else None, "solve_s": placement.solve_s, "fallback": placement.fallback,
            "unplaced": list(placement.unplaced),
            "shares": {service: {group: round(gpus, 3) for group, gpus in groups.items()}
                       for service, groups in placement.shares.items()}}
