"""Which station serves which calls: the broker for everything, or what users run today (§6.1)."""

from __future__ import annotations

from collections.abc import Mapping

from tangram.action import Demand
from tangram.sim.broker_station import BrokerStation
from tangram.sim.cluster import Cluster
from tangram.sim.direct_api import DirectApiStation
from tangram.sim.engine import Policy, Station
from tangram.sim.pods import PodStation
from tangram.sim.static_gpu import StaticGpuStation
from tangram.sim.trace import KINDS


def tangram(cluster: Cluster) -> Mapping[str, Station]:
    """Every call through the broker: elastic test runs (1-32 cores), elastic rewards, API traffic control."""
    return dict.fromkeys(KINDS, BrokerStation(cluster))


def test_cores(demand: Demand) -> Policy:
    """The broker with test runs on ``demand`` cores: a fixed DoP (§6.4's ablation) or another elastic range."""
    def build(cluster: Cluster) -> Mapping[str, Station]:
        return dict.fromkeys(KINDS, BrokerStation(cluster, test_demand=demand))
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


POLICIES: dict[str, Policy] = {"tangram": tangram, "dop4": test_cores(Demand.fixed(4)),
                               "dop16": test_cores(Demand.fixed(16)), "tangram-min4": test_cores(Demand.range(4, 32)),
                               "baseline": baseline}
