"""What a broker's config file deploys, as the simulator models it: ``tangram trace run --config broker.toml`` runs
a saved trace under that file's scheduler profile on that file's CPU nodes, GPU nodes, reward services and
rate-limited APIs, so that an operator can try a change of shape or profile before deploying it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from managers.basic.manager import BasicResourceConfig
from managers.cpu.config import CpuConfig, on_this_host
from managers.gpu.config import GpuConfig
from tangram.sched.profile import SchedulerProfile
from tangram.sim.cluster import ApiModel, Cluster, Costs, ServiceModel
from tangram.sim.trace import Trace

#: an API the config leaves unlimited in one respect: the simulator's stand-in for "no limit"
UNLIMITED = 1 << 30


class NotSimulable(ValueError):
    """A config the simulator cannot model as it stands; ``key`` names the part (as ``ConfigError`` does)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Deployment:
    """A broker's config file as the simulator reads it (the CLI parses and checks the whole file first)."""

    profile: SchedulerProfile
    cpu: CpuConfig
    gpu: GpuConfig
    basic: tuple[BasicResourceConfig, ...]


def deployed_cluster(deployment: Deployment, trace: Trace, costs: Costs | None = None) -> Cluster:
    """The cluster ``deployment`` deploys, with what ``trace`` calls checked against it. A CPU node that leaves its
    cores or memory out takes this machine's, as the broker would on it; a GPU node must give its count (the broker
    asks NVML on the node)."""
    targets = {c.target for t in trace.trajectories for c in t.calls if c.target}
    kinds = {c.kind for t in trace.trajectories for c in t.calls}
    cpu_nodes = _cpu_nodes(deployment.cpu) if {"tool", "test"} & kinds else ()
    if {"tool", "test"} & kinds and not cpu_nodes:
        raise NotSimulable("cpu.nodes", "the trace has CPU calls and the config deploys no CPU node")
    services = _services(deployment.gpu, sorted(t for t in targets if not t.startswith("api.")))
    gpu_sizes, gpu_types, gpu_memory_mb, host_memory_mb = _gpu_nodes(deployment.gpu) if services else ((), (), 0, 0)
    if services and not gpu_sizes:
        raise NotSimulable("gpu.nodes", "the trace has reward calls and the config deploys no GPU node")
    apis = _apis(deployment.basic, sorted(t for t in targets if t.startswith("api.")))
    costs = costs or Costs()
    cluster = Cluster(cpu_nodes=len(cpu_nodes), gpu_node_sizes=gpu_sizes, gpu_node_types=gpu_types,
                      gpu_types=deployment.gpu.types, services=services, apis=apis,
                      costs=replace(costs, test_runner=deployment.cpu.pytest_runner))
    if cpu_nodes:
        cluster = replace(cluster, cores_per_node=cpu_nodes[0][0], node_memory_mb=cpu_nodes[0][1])
    if gpu_sizes:
        cluster = replace(cluster, gpu_memory_mb=gpu_memory_mb, gpu_host_memory_mb=host_memory_mb)
    return cluster


def _one_size(sizes: Sequence[tuple[str, int]], what: str) -> int:
    """The simulator models nodes of one size: the size they share, or a refusal naming the first that differs."""
    first_key, first = sizes[0]
    for key, size in sizes[1:]:
        if size != first:
            raise NotSimulable(key, f"{size} {what}, where {first_key} has {first}: the simulator models nodes of one "
                                    f"size; give each the same")
    return first


def _cpu_nodes(cpu: CpuConfig) -> tuple[tuple[int, int], ...]:
    """(cores, memory MiB) of each CPU node, all one size."""
    if not cpu.enabled:
        return ()
    nodes = []
    for node in cpu.nodes:
        key = f"cpu.nodes.{node.name}"
        node = on_this_host(node)
        if not node.cores or not node.memory_mb:
            raise NotSimulable(f"{key}.cores", "a node behind an agent takes its host's cores and memory: give both "
                                               "to simulate it")
        nodes.append((key, len(node.cores), node.memory_mb))
    cores = _one_size([(f"{key}.cores", n) for key, n, _ in nodes], "cores")
    memory_mb = _one_size([(f"{key}.memory_mb", m) for key, _, m in nodes], "MiB")
    return ((cores, memory_mb),) * len(nodes)


def _gpu_nodes(gpu: GpuConfig) -> tuple[tuple[int, ...], tuple[str, ...], int, int]:
    """Each GPU node's GPU count and type, and the per-GPU and host memory they share."""
    if gpu.enabled is False:
        return (), (), 0, 0
    for node in gpu.nodes:
        if node.gpus == 0:
            raise NotSimulable(f"gpu.nodes.{node.name}.gpus", "0 means every GPU NVML finds on the node: give the "
                                                              "count to simulate it")
    if not gpu.nodes:
        return (), (), 0, 0
    keys = [f"gpu.nodes.{node.name}" for node in gpu.nodes]
    gpu_memory_mb = _one_size([(f"{key}.gpu_memory_mb", node.gpu_memory_mb or int(gpu.types[node.type].memory_mb * 0.9))
                               for key, node in zip(keys, gpu.nodes)], "MiB per GPU")
    host_memory_mb = _one_size([(f"{key}.host_memory_mb", node.host_memory_mb) for key, node in zip(keys, gpu.nodes)],
                               "MiB of host memory")
    if not host_memory_mb:
        raise NotSimulable(f"{keys[0]}.host_memory_mb", "0 means half the node's memory: give it to simulate the node")
    return (tuple(node.gpus for node in gpu.nodes), tuple(node.type for node in gpu.nodes), gpu_memory_mb,
            host_memory_mb)


def _services(gpu: GpuConfig, names: Sequence[str]) -> tuple[ServiceModel, ...]:
    """The reward services the trace calls, as ``[gpu] services`` declares them."""
    declared = {spec.name: spec for spec in gpu.services}
    models = []
    for name in names:
        spec = declared.get(name)
        if spec is None:
            raise NotSimulable("gpu.services", f"the trace calls reward service {name!r}; the config serves "
                                               f"{sorted(declared)}")
        models.append(ServiceModel(name, dops=spec.dops, gpu_memory_mb=spec.gpu_memory_mb,
                                   host_memory_mb=spec.host_memory_mb, generates=spec.task == "generate"))
    return tuple(models)


def _apis(basic: Sequence[BasicResourceConfig], names: Sequence[str]) -> tuple[ApiModel, ...]:
    """The rate-limited APIs the trace calls, with the limits ``[basic.NAME]`` gives them."""
    declared = {resource.name: resource for resource in basic}
    models = []
    for name in names:
        resource = declared.get(name)
        if resource is None:
            raise NotSimulable("basic", f"the trace calls API {name!r}; the config declares {sorted(declared)}")
        models.append(ApiModel(name, quota=resource.quota or UNLIMITED, period_s=resource.period_s,
                               concurrency=resource.concurrency or UNLIMITED))
    return tuple(models)
