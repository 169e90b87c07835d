"""Node agents as Ray actors (issue 17): each CPU node with ``agent = true`` gets one, placed on the Ray node that
carries the custom resource ``tangram_node_<name>`` (``ray start --resources '{"tangram_node_n2": 1}'``), restarted
by Ray when it dies (the restarted agent takes its sandboxes back by their labels). The agent is detached from the
broker's process, so a broker that crashes finds it again under its name when it comes back and adopts through it;
a broker that stops lets it go. Every call carries the broker's leader epoch (``managers/remote/replies.py``), so
after a failover the agent obeys only the new leader. Only a config with such a node imports this module, so a
one-machine broker needs no Ray. ``ray_cluster.py`` joins the cluster, under its token.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from managers.cpu.config import CpuConfig, CpuNodeConfig, on_this_host
from managers.cpu.sandbox_backends import open_sandbox_backend
from managers.remote.broker.agent_backend import AgentBackend
from managers.remote.broker.agent_route import AgentRoute
from managers.remote.broker.ray_cluster import PLACEMENT_TIMEOUT_S, RayUnavailable, call_agent, connect, node_resource
from managers.remote.channel_frames import FRAME_SLACK_BYTES
from managers.remote.node.node_agent import NodeAgent
from managers.remote.replies import Reply, fenced
from sandboxes.backend import NODE_UNAVAILABLE, NodeHardware, SandboxError

log = logging.getLogger("tangram.cpu")


class RayNodeAgent(NodeAgent):
    """The agent as its Ray actor builds it: it opens the node's own backend (its local engine) on that node."""

    def __init__(self, node: CpuNodeConfig, config: CpuConfig) -> None:
        local = on_this_host(replace(node, agent=False))  # the defaults of the agent's own host
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        super().__init__(lambda: open_sandbox_backend(local, config), config.limits,
                         NodeHardware(local.cores, local.memory_mb, local.numa, local.pids),
                         restarted_for=config.broker_id if restarted else None,
                         channel_path=agent_channel_path(node, config), channel_address=ray.util.get_node_ip_address())
        self.remember_epochs_in(agent_epoch_file(node, config))


def agent_epoch_file(node: CpuNodeConfig, config: CpuConfig) -> Path:
    """Where node ``node``'s agent keeps its epoch on its node: beside (not in) the node's run directory, which the
    backend's reaping empties."""
    return Path(config.run_dir) / config.broker_id / f"{node.name}.agent-epoch"


def agent_channel_path(node: CpuNodeConfig, config: CpuConfig) -> Path:
    """Where node ``node``'s agent serves a broker on its host (its direct channel): beside its epoch file, outside
    the node's run directory, whose sandbox directories the sandboxes see."""
    return Path(config.run_dir) / config.broker_id / f"{node.name}.agent.sock"


def reply_limit(config: CpuConfig) -> int:
    """The most bytes an agent's answer on the channel may have: a command's two streams or a file read, and the
    rest of the answer."""
    limits = config.limits
    return 2 * limits.max_output_limit + limits.max_files_bytes + FRAME_SLACK_BYTES


_RemoteAgent: Any = ray.remote(RayNodeAgent)


async def open_agent_backend(node: CpuNodeConfig, config: CpuConfig) -> AgentBackend:
    """The backend of ``node`` through its agent, started: the agent is placed (or found, under its name) and has
    opened the node's engine. Raises ``SandboxError("node_unavailable")`` when no Ray node carries the node's
    resource or the agent does not answer in time."""
    try:
        await asyncio.to_thread(connect, config.ray)
    except RayUnavailable as error:
        raise SandboxError(error.code, error.message) from None
    actor = _RemoteAgent.options(
        name=f"tangram-agent-{config.broker_id}-{node.name}", get_if_exists=True, lifetime="detached", num_cpus=0,
        resources={node_resource(node.name): 0.001}, max_restarts=-1, max_concurrency=1000).remote(node, config)

    agent = f"node {node.name}'s agent"

    async def through_ray(epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
        return await call_agent(actor, "call", (epoch, method, *args), agent, NODE_UNAVAILABLE)

    route = AgentRoute(through_ray, agent, NODE_UNAVAILABLE, reply_limit(config), config.ray.channel)

    async def call(method: str, *args: Any) -> Reply:
        return await fenced(agent, lambda epoch: route.send(epoch, method, args))

    async def release() -> None:
        route.close()
        ray.kill(actor, no_restart=True)

    backend = AgentBackend(call, node.name, release, lambda: route.channel)
    try:
        await asyncio.wait_for(backend.start(), PLACEMENT_TIMEOUT_S)  # its first call waits for the placement
    except TimeoutError:
        ray.kill(actor, no_restart=True)
        raise SandboxError(NODE_UNAVAILABLE, f"node {node.name}'s agent did not start within "
                                               f"{PLACEMENT_TIMEOUT_S:.0f} s: does a Ray node carry the resource "
                                               f"{node_resource(node.name)!r}?") from None
    log.info("node %s: through its agent on the Ray cluster", node.name)
    return backend
