"""Which station serves which calls: the broker for everything, or what users run today (§6.1)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tangram.core.action import Demand
from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.broker_station import BrokerStation
from tangram.sim.cluster import Cluster
from tangram.sim.direct_api import DirectApiStation
from tangram.sim.engine import Policy, Station
from tangram.sim.pods import PodStation
from tangram.sim.static_gpu import StaticGpuStation
from tangram.sim.trace import KINDS


def broker(profile: SchedulerProfile, **options: Any) -> Policy:
    """Every call through the broker under the scheduler ``profile``, with other station settings: test runs on
    another demand (a fixed DoP, §6.4's ablation, or another elastic range), the paper's moldable allocation
    (``malleable=False``), the GPU manager's options."""
    def build(cluster: Cluster) -> Mapping[str, Station]:
        return dict.fromkeys(KINDS, BrokerStation(cluster, profile, **options))
    return build


def baseline(cluster: Cluster) -> Mapping[str, Station]:
    """A pod per trajectory for CPU calls, a static deployment for rewards, direct API calls with retries."""
    routes: dict[str, Station] = {}
    if cluster.cpu_nodes:
        routes["tool"] = routes["test"] = PodStation(cluster)
    if cluster.services:
        routes["reward"] = StaticGpuStation(cluster)
    if cluster.apis:
        routes["api"] = DirectApiStation(cluster)
    return routes


def pods_ideal(cluster: Cluster) -> Mapping[str, Station]:
    """The pod baseline with a free control plane: no bind limit, and a pod starts in the time the broker takes to
    create a sandbox (both start one container; the broker's is charged ``env_create_s``), not the assumed 2 s; the
    same CFS sharing and the same 4-core test runs. A win over it comes from scheduling, not from an assumed
    control-plane cost."""
    free = replace(cluster.costs, pod_bind_per_s=math.inf, pod_start_s=cluster.costs.env_create_s)
    return baseline(replace(cluster, costs=free))


FIXED_DOPS = (1, 2, 4, 8, 16, 32)


def named_policies(profile: SchedulerProfile) -> dict[str, Policy]:
    """The policies by name: the broker's (``tangram`` and its variants) under ``profile``, each variant changed
    from it only where its name says, and the baselines."""
    hrrs = replace(profile, queue_order_by_resource={**profile.queue_order_by_resource, "gpu": "hrrs"})
    return {
        # every call through the broker: malleable test runs (1-32 cores, resized as they run), elastic rewards,
        # API traffic control
        "tangram": broker(profile),
        "tangram-moldable": broker(profile, malleable=False),
        "tangram-paper": broker(replace(profile, estimates=replace(profile.estimates, arrivals=False)),
                                malleable=False),
        "tangram-srpt": broker(replace(profile, elastic=replace(profile.elastic, share_by="remaining"))),
        "tangram-min4": broker(profile, test_demand=Demand.range(4, 32), malleable=False),
        "tangram-hrrs": broker(hrrs),
        "tangram-wait": broker(profile, wait_for_resident=True),
        "tangram-hrrs-wait": broker(hrrs, wait_for_resident=True),
        "tangram-no-prefetch": broker(profile, prefetch=False),
        **{f"dop{d}": broker(profile, test_demand=Demand.fixed(d)) for d in FIXED_DOPS},
        "baseline": baseline,
        "pods-ideal": pods_ideal,
        # ServerlessLLM-style reward serving (the paper's second GPU baseline, Fig. 8b): a model is loaded on
        # demand from host memory onto an instance of its static deployment's DoP (4 GPUs for a teacher) wherever
        # GPUs are free, evicted least recently used, and never reallocated elastically. It runs on the broker's
        # own queue, GPU manager and restore cost, so the difference from ``tangram`` is elastic reallocation
        # alone. Not modelled: its own system overhead, higher than the broker's per the paper (favours it), and
        # batching inside a loaded instance (the broker's instances do not batch either).
        "serverless": broker(profile, static_dops=True),
    }


#: the policies under the broker's default profile
POLICIES = named_policies(DEFAULT_PROFILE)
