"""The ``[ray]`` section: the Ray cluster that the node agents run on (issue 17). One section for the whole broker,
since CPU nodes and GPU nodes behind agents, and nodes that join, all live in the same cluster. Nothing here
imports Ray: a broker without agents never needs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tangram.core.config_tables import TABLE, Text
from tangram.core.errors import ConfigError


@dataclass(frozen=True)
class RayConfig:
    __pydantic_config__ = TABLE

    #: the Ray cluster of the nodes with ``agent = true`` and of joining nodes ("auto": the cluster this host has
    #: joined with ``ray start``)
    address: Text = "auto"
    #: "token": join the cluster only with its token (Ray's token authentication, RAY_AUTH_MODE=token);
    #: "none": without, on a network you trust (whoever reaches the cluster can call the agents)
    auth: Literal["token", "none"] = "token"
    #: how the broker calls the agents: "auto", over each agent's direct channel (a unix socket for an agent on the
    #: broker's host, TLS over TCP to one elsewhere or whose socket is out of the broker's reach) instead of through
    #: Ray, which costs a few milliseconds more per call; "tls": TLS to every agent; "ray": always through Ray
    channel: Literal["auto", "tls", "ray"] = "auto"


#: keys of ``[cpu]`` before the ``[ray]`` section, and where they went
_MOVED = {"ray_address": "address", "ray_auth": "auth"}


def check_no_ray_keys(raw: dict[str, Any], section: str) -> None:
    """The Ray settings belong to ``[ray]``; say so for one written in a manager's section (or an older config)."""
    for key in ("ray", *_MOVED):
        if key in raw:
            moved = f" (now [ray] {_MOVED[key]})" if key in _MOVED else ""
            raise ConfigError(f"{section}.{key}", f"Ray settings belong to the [ray] section{moved}")
