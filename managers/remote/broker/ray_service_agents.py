"""Service agents as Ray actors (issue 17): each GPU node with ``agent = true`` gets one per backend kind it
serves, placed on the Ray node that carries the custom resource ``tangram_gpu_node_<name>``
(``ray start --resources '{"tangram_gpu_node_g1": 1}'``). An agent takes no Ray GPU: the GPU manager decides which
of the node's GPUs an instance uses, by index, as it does on its own host, so Ray is told not to narrow the agent's
``CUDA_VISIBLE_DEVICES``. Ray restarts a dead agent (its instances are made afresh); the agent is owned by the
broker's process and goes with it, since a new broker prepares its services anew. Every call carries the broker's
leader epoch (``managers/remote/replies.py``) as a node agent's does; but since a new leader makes agents of its own,
it never calls the old leader's, so these are fenced only by the old leader's own checks (``tangram/core/fencing.py``)
and go when it stops. The calls go over the agent's direct channel once it is open (``agent_route.py``), as a node
agent's do. Only a config with such a node imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import tempfile
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError

from managers.gpu.config import GpuConfig, GpuNodeConfig, node_on_this_host
from managers.gpu.service_backends import make_service_backend
from managers.remote.broker.agent_route import AgentRoute
from managers.remote.broker.ray_cluster import (
    PLACEMENT_TIMEOUT_S,
    RayUnavailable,
    call_agent,
    connect,
    gpu_node_resource,
)
from managers.remote.channel_frames import FRAME_SLACK_BYTES
from managers.remote.node.service_agent import ServiceAgent
from managers.remote.replies import Reply, failed, fenced, replying
from reward_services.backend import ServiceError
from tangram.core.errors import ConfigError

#: how long a closing broker waits for an agent to close its instances (one on a dead node never answers)
CLOSE_TIMEOUT_S = 10.0


class RayServiceAgent(ServiceAgent):
    """The agent as its Ray actor builds it: the node's own backend of ``kind``, on that node."""

    def __init__(self, kind: str, node: GpuNodeConfig, config: GpuConfig) -> None:
        # its socket in a directory of its own on its node, made (mode 0700) when a broker first asks for it
        channel = Path(tempfile.gettempdir()) / f"tangram-service-agent-{uuid.uuid4().hex}" / "agent.sock"
        super().__init__(lambda: make_service_backend(kind, node, config), config.limits, channel,
                         ray.util.get_node_ip_address())
        self._node = node

    @replying
    async def node_on_its_host(self) -> GpuNodeConfig:
        """The node with the sizes its config left at 0 read here, on its host (NVML, host memory)."""
        try:
            return node_on_this_host(self._node)
        except ConfigError as error:
            raise ServiceError("prepare_failed", f"GPU node {self._node.name}: {error.reason}") from None


_RemoteServiceAgent: Any = ray.remote(RayServiceAgent)


def reply_limit(config: GpuConfig) -> int:
    """The most bytes a service agent's answer on the channel may have: a request's worth of input and as many
    tokens as it may generate (16 bytes each, generously), and the rest of the answer."""
    limits = config.limits
    return limits.max_input_bytes + 16 * limits.max_items * limits.max_new_tokens + FRAME_SLACK_BYTES


class RayServiceLink:
    """The way to node ``node``'s agent for ``kind``: placed at the first call (the GPU manager makes its backends
    before it runs anything), then one call per instance operation, over the agent's channel once it is open."""

    def __init__(self, kind: str, node: GpuNodeConfig, config: GpuConfig) -> None:
        self.node = node.name
        self._kind = kind
        self._node = node
        self._config = config
        self._actor: Any = None
        self._route: AgentRoute | None = None
        self._placing = asyncio.Lock()
        self._agent = f"GPU node {self.node}'s service agent"

    async def _placed(self) -> AgentRoute:
        async with self._placing:
            if self._route is None:
                try:
                    await asyncio.to_thread(connect, self._config.ray)
                except RayUnavailable as error:
                    raise ServiceError("service_unavailable", error.message) from None
                actor = _RemoteServiceAgent.options(
                    num_cpus=0, resources={gpu_node_resource(self.node): 0.001}, max_restarts=-1,
                    max_concurrency=1000,
                    runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
                ).remote(self._kind, self._node, self._config)
                try:
                    await asyncio.wait_for(actor.__ray_ready__.remote(), PLACEMENT_TIMEOUT_S)
                except (TimeoutError, RayError) as error:
                    ray.kill(actor, no_restart=True)
                    raise ServiceError("service_unavailable", f"GPU node {self.node}'s service agent did not start "
                                                              f"within {PLACEMENT_TIMEOUT_S:.0f} s ({error!r}): "
                                                              f"does a Ray node carry the resource "
                                                              f"{gpu_node_resource(self.node)!r}?") from None
                self._actor = actor
                self._route = AgentRoute(functools.partial(self._through_ray, actor), self._agent,
                                         "service_unavailable", reply_limit(self._config), self._config.ray.channel)
            return self._route

    async def _through_ray(self, actor: Any, epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
        return await call_agent(actor, "call", (epoch, method, *args), self._agent, "service_unavailable")

    async def call(self, method: str, *args: Any) -> Reply:
        try:
            route = self._route or await self._placed()
        except ServiceError as error:
            return failed(error.code, error.message)
        return await fenced(self._agent, lambda epoch: route.send(epoch, method, args))

    async def release(self) -> None:
        actor, self._actor = self._actor, None
        if self._route is not None:
            self._route.close()
            self._route = None
        if actor is None:
            return
        with contextlib.suppress(RayError, TimeoutError):
            await asyncio.wait_for(actor.shutdown.remote(), CLOSE_TIMEOUT_S)
        ray.kill(actor, no_restart=True)
