"""Nodes as the Ray cluster holds them (issue 17): a Ray node that carries the custom resource
``tangram_node_<name>`` is CPU node ``<name>``'s host (``tangram_gpu_node_<name>``: GPU node ``<name>``'s). A
manager hears when such a node appears (a node joins, or a lost one comes back) and when it is gone from Ray's node
table (its raylet died or left), without a restart.

Ray decides when a node is dead: its GCS marks a raylet dead after missed health checks, by default about 15 s; a
cluster started with ``--system-config='{"health_check_period_ms": 500, "health_check_failure_threshold": 3}'``
tells within about 4 s. Actions in flight on a dead node lose their agent's connection sooner (about 2 s) and
wait for the verdict (``NodeStanding.lost_within``).

The membership raises ``RayUnavailable`` at start when the broker cannot join the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable

import ray

from managers.remote.broker.ray_cluster import alive_nodes, connect
from managers.remote.broker.ray_config import RayConfig

log = logging.getLogger("tangram.ray")

#: how often the node table is read
POLL_S = 0.5


class RayMembership:
    """Watches Ray's node table for the nodes marked ``<prefix><name>``; tells ``joined(name)`` and
    ``left(name, reason)``, one change at a time per node."""

    def __init__(self, config: RayConfig, prefix: str, joined: Callable[[str], Awaitable[None]],
                 left: Callable[[str, str], Awaitable[None]]) -> None:
        self._config = config
        self._prefix = prefix
        self._joined = joined
        self._left = left
        self._alive: set[str] = set()
        self._per_node: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._changes: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Join the nodes already there (configured ones are in service already) and watch for changes."""
        await asyncio.to_thread(connect, self._config)
        self._alive = await asyncio.to_thread(alive_nodes, self._prefix)
        await asyncio.gather(*(self._joined(name) for name in sorted(self._alive)))
        self._watcher = asyncio.create_task(self._watch(), name="tangram-ray-membership")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                alive = await asyncio.to_thread(alive_nodes, self._prefix)
            except (ray.exceptions.RayError, OSError) as error:  # the GCS is briefly unreachable: keep what we knew
                log.warning("Ray's node table could not be read (%s)", error)
                continue
            for name in sorted(self._alive - alive):
                self._change(name, self._left(name, f"node {name}'s Ray node left the cluster (its raylet is "
                                                    f"gone)"))
            for name in sorted(alive - self._alive):
                self._change(name, self._joined(name))
            self._alive = alive

    def _change(self, name: str, change: Awaitable[None]) -> None:
        """Apply ``change`` after the node's earlier ones, without holding up the watch (a join places an agent)."""
        async def in_turn() -> None:
            async with self._per_node[name]:
                await change

        task = asyncio.create_task(in_turn(), name=f"tangram-node-{name}")
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)

    async def stop(self) -> None:
        for task in [self._watcher, *self._changes]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
