"""Joining the Ray cluster that the node agents run on (issue 17), and how its nodes are marked.

Ray's cluster is the trust boundary: whoever can reach the cluster can call the agents, as whoever can reach a
Docker engine's socket can run containers. Run the cluster on a private network with Ray's token authentication;
the broker refuses to join one without the token, or one that does not enforce it, unless told the network is
trusted (``[ray] auth``). A cluster of several hosts keeps Ray's own addressing; one whose every raylet runs on the
broker's host stays on 127.0.0.1 (``ray_loopback.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

from managers.remote.broker.ray_auth_probe import enforcement_problem
from managers.remote.broker.ray_config import RayConfig
from managers.remote.broker.ray_loopback import LOOPBACK_SWITCH
from managers.remote.replies import Reply, failed
from tangram.core.loopback import is_loopback

log = logging.getLogger("tangram.ray")

#: how long an agent may take to be placed and answer its first call (a Ray worker process starts)
PLACEMENT_TIMEOUT_S = 60.0

#: the custom resources that mark the Ray nodes of CPU nodes: ``tangram_node_<name>``
NODE_RESOURCE_PREFIX = "tangram_node_"
#: and of GPU nodes: ``tangram_gpu_node_<name>`` (one host may be both, under two resources)
GPU_NODE_RESOURCE_PREFIX = "tangram_gpu_node_"


def node_resource(node: str) -> str:
    """The custom resource that marks the Ray node where CPU node ``node``'s agent runs."""
    return NODE_RESOURCE_PREFIX + node


def gpu_node_resource(node: str) -> str:
    """The custom resource that marks the Ray node where GPU node ``node``'s service agent runs."""
    return GPU_NODE_RESOURCE_PREFIX + node


class RayUnavailable(Exception):
    """The broker cannot join the Ray cluster; ``code`` is ``ray_unauthenticated`` or ``ray_unreachable``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


def connect(config: RayConfig) -> None:
    """Join the Ray cluster once per process, quietly (the broker's log stays its own). The cluster is the agents'
    trust boundary, so with ``auth = "token"`` (the default) the broker refuses to join without the cluster's
    token, or a cluster that accepts a wrong one (``ray_auth_probe``). A cluster named by a loopback address is
    joined on loopback only. Raises ``RayUnavailable``."""
    if ray.is_initialized():
        return
    host = config.address.rpartition(":")[0].strip("[]")
    advertised = ray.util.get_node_ip_address()
    if is_loopback(host) and not is_loopback(advertised):
        raise RayUnavailable("ray_unreachable", f"not joining the Ray cluster at {config.address!r} through "
                                                f"{advertised}: Ray rewrites a loopback address to this host's "
                                                f"interface unless the broker (and every node of a cluster on "
                                                f"this host) starts with {LOOPBACK_SWITCH}=0")
    if config.auth == "token":
        problem = token_problem(os.environ, Path.home())
        if problem is not None:
            raise RayUnavailable("ray_unauthenticated", f"not joining the Ray cluster at {config.address!r} "
                                                        f"without its token ({problem}): start the cluster and "
                                                        f"the broker with RAY_AUTH_MODE=token and the cluster's "
                                                        f"token, or set [ray] auth = \"none\" on a network you "
                                                        f"trust")
    else:
        log.warning("joining the Ray cluster at %r without token authentication ([ray] auth = \"none\"): whoever "
                    "reaches the cluster can call the node agents", config.address)
    try:
        ray.init(address=config.address, namespace="tangram", logging_level=logging.WARNING,
                 log_to_driver=False, configure_logging=False)
    except ConnectionError as error:
        raise RayUnavailable("ray_unreachable", f"the Ray cluster at {config.address!r} did not accept the "
                                                f"broker (down, or another token): {error}") from None
    if config.auth == "token":
        problem = enforcement_problem(ray.get_runtime_context().gcs_address)
        if problem is not None:
            ray.shutdown()
            raise RayUnavailable("ray_unauthenticated", f"not joining the Ray cluster at {config.address!r}: it "
                                                        f"does not enforce token authentication ({problem}): "
                                                        f"start every node of the cluster with RAY_AUTH_MODE=token "
                                                        f"and its token, or set [ray] auth = \"none\" on a network "
                                                        f"you trust")


async def call_agent(actor: Any, method: str, args: tuple[Any, ...], agent: str, unavailable: str) -> Reply:
    """One call to an agent actor, its transport failures as error replies: ``node_lost`` (lost) when the actor
    died for good, ``unavailable`` while Ray restarts it. ``agent`` names it in the messages."""
    try:
        reply: Reply = await getattr(actor, method).remote(*args)
    except ActorDiedError as error:
        return failed("node_lost", f"{agent} died: {error.error_msg or error}", lost=True)
    except RayActorError as error:  # restarting: the call may be tried again
        return failed(unavailable, f"{agent} is unavailable: {error}")
    return reply


def alive_nodes(prefix: str) -> set[str]:
    """The names of the nodes (marked ``<prefix><name>``) whose Ray node is alive now."""
    return {key.removeprefix(prefix) for node in ray.nodes() if node["Alive"]
            for key in node["Resources"] if key.startswith(prefix)}
