"""A real two-node Ray cluster on this machine for the agent tests (issue 17): a head and one more raylet, each
carrying the custom resource that marks a tangram node, with Ray's token authentication on (the token is the
session's, tests/conftest.py) and dead raylets told within about 4 s."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.cluster_utils import Cluster

#: each Ray node: one CPU and a small object store (Ray's default takes 30% of this machine's memory per node)
NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 << 20}
#: the GCS marks a raylet dead after three missed health checks 0.5 s apart (Ray's default takes ~15 s)
HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


@contextmanager
def two_node_cluster(head_resource: str, worker_resource: str) -> Iterator[Cluster]:
    """The head carries ``head_resource``, the second raylet ``worker_resource``; both go at the end, with this
    process's connection to them."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {head_resource: 1},
                                                            "_system_config": HEALTH_CHECKS})
    cluster.add_node(**NODE, resources={worker_resource: 1})
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
