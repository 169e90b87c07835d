"""A real two-node Ray cluster on this machine for the agent tests (issue 17): a head and one more raylet, each
carrying the custom resource that marks a tangram node, with Ray's token authentication on (the token is the
session's, tests/conftest.py), dead raylets told within about 4 s, and every listener and peer on 127.0.0.1 (issue
35: the loopback switch is set by tests/conftest.py before Ray is imported; tests/test_ray_boundary.py checks it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.cluster_utils import Cluster

from managers.remote.broker.ray_loopback import LOOPBACK_NODE, one_machine_cluster

#: each Ray node: one CPU, a small object store (Ray's default takes 30% of this machine's memory per node), on
#: loopback (for the nodes a test adds itself)
NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 << 20, **LOOPBACK_NODE}
#: the GCS marks a raylet dead after three missed health checks 0.5 s apart (Ray's default takes ~15 s)
HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


@contextmanager
def two_node_cluster(head_resource: str, worker_resource: str) -> Iterator[Cluster]:
    """The head carries ``head_resource``, the second raylet ``worker_resource``; both go at the end, with this
    process's connection to them."""
    cluster = one_machine_cluster({**NODE, "resources": {head_resource: 1}, "_system_config": HEALTH_CHECKS},
                                  {**NODE, "resources": {worker_resource: 1}})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
