"""Node agents as Ray actors (issue 17): each CPU node with ``agent = true`` gets one, placed on the Ray node that
carries the custom resource ``tangram_node_<name>`` (``ray start --resources '{"tangram_node_n2": 1}'``), restarted
by Ray when it dies (the restarted agent takes its sandboxes back by their labels). The agent is detached from the
broker's process, so a broker that crashes finds it again under its name when it comes back and adopts through it;
a broker that stops lets it go. Only a config with such a node imports this module, so a one-machine broker needs
no Ray.

Ray's cluster is the trust boundary: whoever can reach the cluster can call the agents, as whoever can reach a
Docker engine's socket can run containers. Run the cluster on a private network with Ray's token authentication;
the broker refuses to join one without the token unless told the network is trusted (``cpu.ray_auth``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

from managers.agent_backend import AgentBackend
from managers.agent_replies import Reply, failed
from managers.cpu_config import CpuConfig, CpuNodeConfig, on_this_host
from managers.node_agent import NodeAgent
from managers.sandbox_backends import open_sandbox_backend
from sandboxes.backend import NODE_UNAVAILABLE, NodeHardware, SandboxError

log = logging.getLogger("tangram.cpu")

#: how long an agent may take to be placed and answer its first call (a Ray worker process starts)
PLACEMENT_TIMEOUT_S = 60.0


#: the custom resources that mark the Ray nodes of CPU nodes: ``tangram_node_<name>``
NODE_RESOURCE_PREFIX = "tangram_node_"


def node_resource(node: str) -> str:
    """The custom resource that marks the Ray node where node ``node``'s agent runs."""
    return NODE_RESOURCE_PREFIX + node


class RayNodeAgent(NodeAgent):
    """The agent as its Ray actor builds it: it opens the node's own backend (its local engine) on that node."""

    def __init__(self, node: CpuNodeConfig, config: CpuConfig) -> None:
        local = on_this_host(replace(node, agent=False))  # the defaults of the agent's own host
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        super().__init__(lambda: open_sandbox_backend(local, config), config.limits,
                         NodeHardware(local.cores, local.memory_mb, local.numa),
                         restarted_for=config.broker_id if restarted else None)


_RemoteAgent: Any = ray.remote(RayNodeAgent)


def token_problem(environ: Mapping[str, str], home: Path) -> str | None:
    """Why this process would reach the Ray cluster without its token (Ray's token authentication, Ray >= 2.52:
    ``RAY_AUTH_MODE=token`` and the token from ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, or
    ``~/.ray/auth_token``); None when it has one."""
    if environ.get("RAY_AUTH_MODE") != "token":
        return "RAY_AUTH_MODE is not \"token\""
    if environ.get("RAY_AUTH_TOKEN"):
        return None
    path = Path(environ.get("RAY_AUTH_TOKEN_PATH") or home / ".ray" / "auth_token")
    try:
        if path.read_text().strip():
            return None
    except OSError:
        pass
    return f"no token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or {path}"


def connect(config: CpuConfig) -> None:
    """Join the Ray cluster once per process, quietly (the broker's log stays its own). The cluster is the agents'
    trust boundary, so with ``ray_auth = "token"`` (the default) the broker refuses to join without the cluster's
    token."""
    if ray.is_initialized():
        return
    if config.ray_auth == "token":
        problem = token_problem(os.environ, Path.home())
        if problem is not None:
            raise SandboxError("ray_unauthenticated", f"not joining the Ray cluster at {config.ray_address!r} "
                                                      f"without its token ({problem}): start the cluster and the "
                                                      f"broker with RAY_AUTH_MODE=token and the cluster's token, "
                                                      f"or set cpu.ray_auth = \"none\" on a network you trust")
    else:
        log.warning("joining the Ray cluster at %r without token authentication (cpu.ray_auth = \"none\"): whoever "
                    "reaches the cluster can call the node agents", config.ray_address)
    try:
        ray.init(address=config.ray_address, namespace="tangram", logging_level=logging.WARNING,
                 log_to_driver=False, configure_logging=False)
    except ConnectionError as error:
        raise SandboxError("ray_unreachable", f"the Ray cluster at {config.ray_address!r} did not accept the "
                                              f"broker (down, or another token): {error}") from None


async def open_agent_backend(node: CpuNodeConfig, config: CpuConfig) -> AgentBackend:
    """The backend of ``node`` through its agent, started: the agent is placed (or found, under its name) and has
    opened the node's engine. Raises ``SandboxError("node_unavailable")`` when no Ray node carries the node's
    resource or the agent does not answer in time."""
    await asyncio.to_thread(connect, config)
    actor = _RemoteAgent.options(
        name=f"tangram-agent-{config.broker_id}-{node.name}", get_if_exists=True, lifetime="detached", num_cpus=0,
        resources={node_resource(node.name): 0.001}, max_restarts=-1, max_concurrency=1000).remote(node, config)

    async def call(method: str, *args: Any) -> Reply:
        try:
            reply: Reply = await getattr(actor, method).remote(*args)
        except ActorDiedError as error:
            return failed("node_lost", f"node {node.name}'s agent died: {error.error_msg or error}", lost=True)
        except RayActorError as error:  # restarting: the call may be tried again
            return failed(NODE_UNAVAILABLE, f"node {node.name}'s agent is unavailable: {error}")
        return reply

    async def release() -> None:
        ray.kill(actor, no_restart=True)

    backend = AgentBackend(call, node.name, release)
    try:
        await asyncio.wait_for(backend.start(), PLACEMENT_TIMEOUT_S)  # its first call waits for the placement
    except TimeoutError:
        ray.kill(actor, no_restart=True)
        raise SandboxError(NODE_UNAVAILABLE, f"node {node.name}'s agent did not start within "
                                               f"{PLACEMENT_TIMEOUT_S:.0f} s: does a Ray node carry the resource "
                                               f"{node_resource(node.name)!r}?") from None
    log.info("node %s: through its agent on the Ray cluster", node.name)
    return backend
