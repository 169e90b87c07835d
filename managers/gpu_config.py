"""Configuration of the GPU manager: its nodes (GPUs, memory budgets) and the reward services it hosts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import psutil

from managers.config_checks import check_table, int_limits, positive_int
from managers.gpu_discovery import discover_gpus
from reward_services.backend import BACKEND_OPTIONS, LEGAL_DOPS, TASKS, ServiceSpec
from reward_services.requests import RewardLimits
from tangram.core.errors import ConfigError

BACKENDS = tuple(BACKEND_OPTIONS)
DEVICE_TYPES = ("cuda", "cpu")
#: what the torch worker computes (an embedding model); SGLang serves every task
BACKEND_TASKS = {"torch": ("similarity",), "sglang": TASKS}


@dataclass(frozen=True)
class GpuNodeConfig:
    """One GPU node. ``device_type = "cpu"`` makes virtual GPUs on the CPU (tests, CI): same code path, and
    ``gpu_memory_mb`` is then a budget the manager enforces rather than a card's memory."""

    name: str
    gpus: int
    gpu_memory_mb: int  # per GPU, for resident services
    host_memory_mb: int  # for the host copies of every service's weights
    device_type: str = "cuda"


@dataclass(frozen=True)
class GpuConfig:
    enabled: bool = False
    nodes: tuple[GpuNodeConfig, ...] = ()
    services: tuple[ServiceSpec, ...] = ()
    #: where SGLang servers write their logs
    log_dir: str = "/var/log/tangram/services" if os.geteuid() == 0 else f"/tmp/tangram-{os.geteuid()}/services"
    limits: RewardLimits = field(default_factory=RewardLimits)


TOP_KEYS = {"enabled", "nodes", "services", "log_dir", "limits"}
NODE_KEYS = {"gpus", "gpu_memory_mb", "host_memory_mb", "device_type"}
SERVICE_KEYS = {"backend", "model", "task", "dops", "gpu_memory_mb", "host_memory_mb", "options"}


def parse_gpu_config(raw: Any) -> GpuConfig:
    """``enabled`` defaults to "auto": on when nodes are configured or NVML finds GPUs on this host."""
    check_table(raw, "gpu", TOP_KEYS)
    enabled = raw.get("enabled", "auto")
    if enabled not in (True, False, "auto"):
        raise ConfigError("gpu.enabled", 'must be true, false or "auto"')
    nodes_raw = raw.get("nodes")
    if nodes_raw is None:
        found = discover_gpus()
        if enabled is False or (enabled == "auto" and not found):
            return GpuConfig(enabled=False)
        if not found:
            raise ConfigError("gpu.nodes", "no GPU found on this host (NVML): configure [gpu.nodes.NAME] tables")
        nodes_raw = {"local": {}}
    if not isinstance(nodes_raw, dict) or not nodes_raw:
        raise ConfigError("gpu.nodes", "must be a table of at least one node")
    nodes = tuple(_node(name, spec) for name, spec in nodes_raw.items())
    services_raw = raw.get("services", {})
    if not isinstance(services_raw, dict):
        raise ConfigError("gpu.services", "must be a table of service name = settings")
    services = tuple(_service(name, spec) for name, spec in services_raw.items())
    log_dir = raw.get("log_dir", GpuConfig.log_dir)
    if not isinstance(log_dir, str) or not log_dir:
        raise ConfigError("gpu.log_dir", "must be a non-empty string")
    return GpuConfig(enabled=enabled is not False, nodes=nodes, services=services, log_dir=log_dir,
                     limits=int_limits(RewardLimits, raw.get("limits", {}), "gpu.limits"))


def _node(name: str, raw: Any) -> GpuNodeConfig:
    where = f"gpu.nodes.{name}"
    check_table(raw, where, NODE_KEYS)
    device_type = raw.get("device_type", "cuda")
    if device_type not in DEVICE_TYPES:
        raise ConfigError(f"{where}.device_type", f"must be one of {list(DEVICE_TYPES)}")
    found = discover_gpus() if device_type == "cuda" else ()
    gpus = raw.get("gpus", len(found))
    if gpus == 0 and "gpus" not in raw:
        raise ConfigError(f"{where}.gpus", "no GPU found on this host (NVML): set the node's GPU count")
    gpus = positive_int(gpus, f"{where}.gpus")
    memory = raw.get("gpu_memory_mb")
    if memory is None:
        if not found:
            raise ConfigError(f"{where}.gpu_memory_mb", "is required when NVML cannot read the GPUs' memory")
        memory = int(min(g.memory_mb for g in found) * 0.9)  # leave the driver and activations some room
    host = raw.get("host_memory_mb", int(psutil.virtual_memory().total * 0.5) >> 20)
    return GpuNodeConfig(name=name, gpus=gpus, gpu_memory_mb=positive_int(memory, f"{where}.gpu_memory_mb"),
                         host_memory_mb=positive_int(host, f"{where}.host_memory_mb"), device_type=device_type)


def _service(name: str, raw: Any) -> ServiceSpec:
    where = f"gpu.services.{name}"
    check_table(raw, where, SERVICE_KEYS)
    backend = raw.get("backend")
    if backend not in BACKENDS:
        raise ConfigError(f"{where}.backend", f"must be one of {list(BACKENDS)}")
    task = raw.get("task", "similarity" if backend == "torch" else "classify")
    if task not in BACKEND_TASKS[backend]:
        raise ConfigError(f"{where}.task", f"the {backend} backend serves {list(BACKEND_TASKS[backend])}")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}.model", "must name the model (a path, a model id or a model package)")
    dops = raw.get("dops", [1])
    if (not isinstance(dops, list) or not dops or len(set(dops)) != len(dops)
            or not all(d in LEGAL_DOPS and not isinstance(d, bool) for d in dops)):
        raise ConfigError(f"{where}.dops", f"must be a list of distinct degrees of parallelism from {list(LEGAL_DOPS)}")
    options = raw.get("options", {})
    check_table(options, f"{where}.options", BACKEND_OPTIONS[backend])
    return ServiceSpec(name=name, backend=backend, model=model, task=task, dops=tuple(sorted(dops)),
                       gpu_memory_mb=positive_int(raw.get("gpu_memory_mb"), f"{where}.gpu_memory_mb"),
                       host_memory_mb=positive_int(raw.get("host_memory_mb"), f"{where}.host_memory_mb"),
                       options=options)
