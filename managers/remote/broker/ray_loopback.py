"""A Ray cluster whose every raylet runs on this machine stays on 127.0.0.1 (issue 35): the tests' and benchmarks'
clusters, and a one-machine deployment's.

Left alone, Ray advertises this host's interface address as every node's address, rewrites a driver's
``ray.init("127.0.0.1:P")`` to that address and binds its servers to all interfaces, so a cluster on one machine
talks through the interface. Ray's own switch for one-machine clusters, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
makes it take 127.0.0.1 as the node address instead (``ray._private.services.get_node_ip_address``); its servers
then listen on 127.0.0.1 only. Ray reads the switch once, when it is imported, and the processes it starts inherit
it, so it must be set before ``import ray`` in every process of the cluster, drivers included: a driver without it
rewrites 127.0.0.1 to the interface address and never reaches a loopback cluster. Nothing here imports Ray at
module level, so a process can set the switch through this module first.

A cluster of several hosts keeps Ray's own addressing: there the switch would leave each raylet unreachable from
the others (and ``ray start --address`` refuses to start a worker node under it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tangram.core.loopback import is_loopback

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

#: Ray's switch between cluster addressing ("1", its default on Linux) and loopback addressing ("0")
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_IP = "127.0.0.1"
#: the node argument of ``ray.cluster_utils.Cluster`` that names a raylet's address, for each node it starts
LOOPBACK_NODE: dict[str, Any] = {"node_ip_address": LOOPBACK_IP}


def keep_ray_on_loopback() -> None:
    """Set Ray's loopback switch for this process and the Ray processes it starts. Raises ``RuntimeError`` when Ray
    was imported before without it (the switch would come too late)."""
    os.environ[LOOPBACK_SWITCH] = "0"
    if "ray" in sys.modules:
        import ray.util

        address = ray.util.get_node_ip_address()
        if not is_loopback(address):
            raise RuntimeError(f"Ray was imported before {LOOPBACK_SWITCH}=0 was set: it advertises {address}")


def one_machine_cluster(head: Mapping[str, Any], *others: Mapping[str, Any]) -> Cluster:
    """A Ray cluster of a head and one more raylet per entry of ``others`` on this machine (tests, benchmarks),
    each started with these node arguments on 127.0.0.1; every listener and peer stays on loopback."""
    keep_ray_on_loopback()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**head, **LOOPBACK_NODE})
    for node in others:
        cluster.add_node(**{**node, **LOOPBACK_NODE})
    cluster.wait_for_nodes()
    return cluster
