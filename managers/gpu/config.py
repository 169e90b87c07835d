"""Configuration of the GPU manager: its nodes (GPUs, memory budgets), the reward services it hosts, and the
arguments of its fit (``[gpu.fit]``) and its live placement (``[gpu.placement]``). A key that ``[gpu]`` held before
those tables is refused with the place it moved to (``refuse_moved``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import psutil

from managers.gpu.discovery import discover_gpus
from managers.gpu.gpu_types import GPU_TYPES, REFERENCE_TYPE, GpuType, merge_types
from managers.remote.broker.ray_config import RayConfig, check_no_ray_keys
from reward_services.backend import TASKS, ServiceSpec
from reward_services.options import OPTIONS
from reward_services.requests import RewardLimits
from tangram.core.config_tables import (
    TABLE,
    AutoFlag,
    Flag,
    NonNegative,
    PositiveSeconds,
    Text,
    named_tables,
    table,
)
from tangram.core.errors import ConfigError

#: ``[gpu.placement] method``: "auto" (ILP on nodes of several types), "none", or the method to solve it with
PlacementChoice = Literal["auto", "none", "ilp", "greedy"]

#: what the torch worker computes (an embedding model); SGLang serves every task
BACKEND_TASKS = {"torch": ("similarity",), "sglang": TASKS}


@dataclass(frozen=True)
class GpuNodeConfig:
    """One GPU node. ``device_type = "cpu"`` makes virtual GPUs on the CPU (tests, CI): same code path, and
    ``gpu_memory_mb`` is then a budget the manager enforces rather than a card's memory. A size left at 0 is read
    from this host at manager start (``on_this_host``)."""

    __pydantic_config__ = TABLE

    name: str
    gpus: NonNegative = 0  # 0: every GPU NVML finds
    gpu_memory_mb: NonNegative = 0  # per GPU, for resident services; 0: 90% of the smallest GPU's memory
    host_memory_mb: NonNegative = 0  # for the host copies of every service's weights; 0: half this host's memory
    device_type: Literal["cuda", "cpu"] = "cuda"
    #: through its service agents on the Ray node that carries ``tangram_gpu_node_<name>`` (``[ray]``); its sizes
    #: are then required, since the broker's host cannot read them
    agent: Flag = False
    #: the disk tier below host memory (``managers/gpu/host_tier.py``): a directory on the node's local disk (on its own
    #: host for a node behind an agent) where the torch services' host copies spill when they need more than
    #: ``host_memory_mb``; absent: no disk tier
    disk_dir: Text | None = None
    #: its GPUs' type, a name in ``[gpu.types]`` (``managers/gpu/gpu_types.py``); left out: ``cpu`` for virtual GPUs,
    #: else the reference type (a cluster whose nodes name no type is homogeneous, whatever its cards are)
    type: Text = REFERENCE_TYPE


@dataclass(frozen=True)
class GpuJoinConfig:
    """How a GPU node that joins from the Ray cluster is sized: a Ray node carrying ``tangram_gpu_node_<name>``
    that no ``[gpu.nodes]`` table names becomes GPU node ``<name>`` behind its agents; a size left at 0 is read by
    its agent on its host (NVML, host memory), as ``on_this_host`` reads this host's."""

    __pydantic_config__ = TABLE

    gpus: NonNegative = 0
    gpu_memory_mb: NonNegative = 0
    host_memory_mb: NonNegative = 0
    device_type: Literal["cuda", "cpu"] = "cuda"

    def node(self, name: str) -> GpuNodeConfig:
        return GpuNodeConfig(name=name, gpus=self.gpus, gpu_memory_mb=self.gpu_memory_mb,
                             host_memory_mb=self.host_memory_mb, device_type=self.device_type, agent=True,
                             type=_default_type(self.device_type))


@dataclass(frozen=True)
class GpuFitArgs:
    """``[gpu.fit]``: the arguments of the GPU manager's fit (``managers/gpu/fit.py``), which places each reward
    action on a node in a scheduling pass."""

    __pydantic_config__ = TABLE

    #: an action whose service is resident on busy GPUs waits up to one restore's time for them before it is
    #: restored on free ones elsewhere (delay scheduling, ``managers/gpu/delay_wait.py``)
    wait_for_resident: Flag = False
    #: on nodes of more than one type, an action goes where it is expected to end first (its restore if not
    #: resident there, plus its run time on that type as measured); off: the type-blind fit of one type
    typed: Flag = True


@dataclass(frozen=True)
class GpuPlacementArgs:
    """``[gpu.placement]``: the placement the GPU manager solves from the demand it measures
    (``managers/gpu/live_placement.py``); its fit then looks only at the nodes each service is placed on."""

    __pydantic_config__ = TABLE

    #: which node groups each service may run on: "auto" is "ilp" when the nodes are of more than one type and
    #: "none" otherwise (on one type every service would be placed on every node)
    method: PlacementChoice = "auto"
    #: how often the placement is solved again (also at once when services are added or nodes leave or join)
    interval_s: PositiveSeconds = 30.0
    #: the time constant of the demand the placement is solved for (``managers/gpu/service_demand.py``)
    window_s: PositiveSeconds = 300.0
    #: HiGHS's time limit per solve; past it the greedy's answer is taken
    time_limit_s: PositiveSeconds = 1.0


@dataclass(frozen=True)
class GpuConfig:
    __pydantic_config__ = TABLE

    #: None ("auto"): on when nodes are configured or NVML finds GPUs on this host
    enabled: AutoFlag = None
    nodes: tuple[GpuNodeConfig, ...] = ()
    services: tuple[ServiceSpec, ...] = ()
    #: where SGLang servers write their logs
    log_dir: Text = "/var/log/tangram/services" if os.geteuid() == 0 else f"/tmp/tangram-{os.geteuid()}/services"
    limits: RewardLimits = field(default_factory=RewardLimits)
    #: GPU nodes join (and leave) at runtime from the Ray cluster; absent: only the configured nodes serve
    join: GpuJoinConfig | None = None
    #: the ``[ray]`` section, for the nodes with ``agent = true`` and joining nodes (``parse_config`` sets it)
    ray: RayConfig = field(default_factory=RayConfig)
    #: GPU types by name: the shipped ones with the ``[gpu.types.NAME]`` tables merged in
    types: Mapping[str, GpuType] = field(default_factory=lambda: dict(GPU_TYPES))
    #: ``[gpu.fit]``: what the fit weighs where the nodes are busy or of several types
    fit: GpuFitArgs = field(default_factory=GpuFitArgs)
    #: ``[gpu.placement]``: the placement the manager solves from the demand it measures
    placement: GpuPlacementArgs = field(default_factory=GpuPlacementArgs)

    @property
    def placement_method(self) -> Literal["ilp", "greedy"] | None:
        """The placement the manager solves, "auto" resolved by the nodes' types; None for none."""
        method = self.placement.method
        if method == "auto":
            return "ilp" if len({node.type for node in self.nodes}) > 1 else None
        return None if method == "none" else method


#: the keys ``[gpu]`` held before they moved under the plugin that reads them, and where each went
MOVED = {
    "wait_for_resident": "[gpu.fit] wait_for_resident",
    "typed_fit": "[gpu.fit] typed",
    "placement": "[gpu.placement] method (\"auto\", \"none\", \"ilp\" or \"greedy\")",
    "placement_interval_s": "[gpu.placement] interval_s",
    "placement_window_s": "[gpu.placement] window_s",
    "placement_time_limit_s": "[gpu.placement] time_limit_s",
}


def refuse_moved(raw: Mapping[str, Any]) -> None:
    """Name where an older config's ``[gpu]`` key went, rather than calling it unknown. ``placement`` is moved
    only when it is not a table: ``[gpu.placement]`` is its new form."""
    for key, now in MOVED.items():
        if key in raw and not (key == "placement" and isinstance(raw[key], dict)):
            raise ConfigError(f"gpu.{key}", f"moved: now {now}")


def parse_gpu_config(raw: Any) -> GpuConfig:
    """The ``[gpu]`` section; ``enabled`` defaults to "auto". Nothing here probes NVML (``wanted`` does)."""
    inner = {"nodes", "services", "types"}
    if isinstance(raw, dict):
        check_no_ray_keys(raw, "gpu")
        refuse_moved(raw)
    config = table(GpuConfig, {k: v for k, v in raw.items() if k not in inner} if isinstance(raw, dict) else raw,
                   "gpu")
    types = merge_types(raw.get("types", {}), "gpu.types")
    raw_nodes = raw.get("nodes", {})
    if isinstance(raw_nodes, dict):
        raw_nodes = {name: {"type": _default_type(body.get("device_type")), **body} if isinstance(body, dict)
                     else body for name, body in raw_nodes.items()}
    nodes = named_tables(GpuNodeConfig, raw_nodes, "gpu.nodes")
    if "nodes" in raw and not nodes:
        raise ConfigError("gpu.nodes", "must be a table of at least one node")
    for node in nodes:
        if node.type not in types:
            raise ConfigError(f"gpu.nodes.{node.name}.type", f"unknown GPU type {node.type!r}; known types are "
                                                              f"{sorted(types)} (add a [gpu.types.{node.type}] table)")
        for size in ("gpus", "gpu_memory_mb", "host_memory_mb"):
            if node.agent and not getattr(node, size):
                raise ConfigError(f"gpu.nodes.{node.name}.{size}", "is required for a node behind an agent (the "
                                                                    "broker's host cannot read it)")
    services = raw.get("services", {})
    if not isinstance(services, dict):
        raise ConfigError("gpu.services", "must be a table of service name = settings")
    return replace(config, nodes=nodes, types=types,
                   services=tuple(_service(name, body) for name, body in services.items()))


def _default_type(device_type: Any) -> str:
    """A node's type when its table names none: virtual GPUs are ``cpu``; CUDA ones the reference type."""
    return "cpu" if device_type == "cpu" else REFERENCE_TYPE


def _service(name: str, raw: Any) -> ServiceSpec:
    """A service table: the task's default and the options' type depend on the backend."""
    where = f"gpu.services.{name}"
    body = {k: v for k, v in raw.items() if k != "options"} if isinstance(raw, dict) else raw
    if isinstance(body, dict):
        body = {"task": "similarity" if body.get("backend") == "torch" else "classify", "dops": [1], **body}
    spec = named_tables(ServiceSpec, {name: body}, "gpu.services")[0]
    if spec.task not in BACKEND_TASKS[spec.backend]:
        raise ConfigError(f"{where}.task", f"the {spec.backend} backend serves {list(BACKEND_TASKS[spec.backend])}")
    options = table(OPTIONS[spec.backend], raw.get("options", {}), f"{where}.options")
    return replace(spec, options=options)


def wanted(config: GpuConfig) -> bool:
    """Whether this broker runs a GPU manager: enabled, or "auto" with nodes configured or joining, or GPUs found
    here."""
    return bool(config.enabled or (config.enabled is None and (config.nodes or config.join or discover_gpus())))


def on_this_host(config: GpuConfig) -> GpuConfig:
    """``config`` with what it left out read from this host (NVML, host memory); the manager calls it at start.
    Nodes behind agents are sized in the config, or by their agents when they join."""
    nodes = config.nodes
    if not nodes and config.join is None:
        if not discover_gpus():
            raise ConfigError("gpu.nodes", "no GPU found on this host (NVML): configure [gpu.nodes.NAME] tables")
        nodes = (GpuNodeConfig(name="local"),)
    return replace(config, enabled=True, nodes=tuple(node if node.agent else node_on_this_host(node)
                                                     for node in nodes))


def node_on_this_host(node: GpuNodeConfig) -> GpuNodeConfig:
    """``node`` with the sizes it left at 0 read from this host (a joining node's agent calls it on its own)."""
    where = f"gpu.nodes.{node.name}"
    found = discover_gpus() if node.device_type == "cuda" else ()
    gpus = node.gpus or len(found)
    if not gpus:
        raise ConfigError(f"{where}.gpus", "no GPU found on this host (NVML): set the node's GPU count")
    memory = node.gpu_memory_mb or int(min((g.memory_mb for g in found), default=0) * 0.9)  # room for the driver
    if not memory:
        raise ConfigError(f"{where}.gpu_memory_mb", "is required when NVML cannot read the GPUs' memory")
    host = node.host_memory_mb or int(psutil.virtual_memory().total * 0.5) >> 20
    return replace(node, gpus=gpus, gpu_memory_mb=memory, host_memory_mb=host)
