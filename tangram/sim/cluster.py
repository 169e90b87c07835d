"""The external resources a simulated run has: CPU nodes, GPU nodes with their reward services, rate-limited APIs,
and the costs the simulator charges besides execution (all in seconds, each with where its figure comes from)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import get_args

from managers.cpu.exec_spec import PytestRunner
from managers.gpu.gpu_types import GPU_TYPES, REFERENCE_TYPE, Bound, GpuType


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """A reward service: its GPU footprint and how long a restore from host memory takes."""

    name: str
    dops: tuple[int, ...] = (1, 2, 4, 8)
    gpu_memory_mb: int = 40_960  # per GPU while resident (weights + KV cache)
    host_memory_mb: int = 16_384  # one host copy of the weights (an 8B model in bf16)
    static_replicas: int = 1  # the static baseline's deployment: replicas of static_dop GPUs each (paper §6.1)
    static_dop: int = 4
    generates: bool = False  # a judge that generates text (decode-bound); a teacher only scores (prefill-bound)

    @property
    def bound(self) -> Bound:
        """What limits its speed on a GPU type (``managers/gpu/gpu_types.py``): memory bandwidth if it generates."""
        return "memory" if self.generates else "compute"


@dataclass(frozen=True, slots=True)
class StaticServing:
    """How a static deployment's server (SGLang in the paper) batches the calls it holds: up to ``batch`` at once,
    continuous batching, each call progressing at ``1 / (1 + slowdown * (n - 1))`` of its solo speed while ``n``
    are in the batch (slowdown 1: batching gains nothing; 0: a batch of n costs no more than one call)."""

    batch: int = 16  # calls a server holds at once (assumed)
    prefill_slowdown: float = 0.8  # teachers' log-prob scoring: long prefills keep the GPUs busy alone (assumed)
    judge_slowdown: float = 0.3  # the judge decodes its verdict: batching fills the GPUs (assumed)

    def slowdown(self, service: ServiceModel) -> float:
        return self.judge_slowdown if service.generates else self.prefill_slowdown


@dataclass(frozen=True, slots=True)
class ApiModel:
    """An upstream API: the quota and concurrency it really enforces (the broker is configured with the same)."""

    name: str
    quota: int = 600  # calls per period (the paper's example: 600 calls/min)
    period_s: float = 60.0
    concurrency: int = 64  # calls in flight above which the upstream stops answering (they time out)


@dataclass(frozen=True, slots=True)
class HeteroParams:
    """``gpu-hetero``'s H20 against its datasheet (``--set hetero.*``): the speed ratio to the H100 decides what a
    typed fit and a placement gain, so it must move. Each factor multiplies the shipped figure; only faster than
    the datasheet (at least 1), the side where the gain shrinks."""

    tflops_factor: float = 1.0  # compute: an H20 runs a scorer at 0.150 x this of an H100's speed
    hbm_factor: float = 1.0  # memory bandwidth: a generator at 1.194 x this


#: what the simulator's test runs can run on (``Costs.test_runner``): the broker's choices
TEST_RUNNERS: tuple[str, ...] = get_args(PytestRunner)


@dataclass(frozen=True, slots=True)
class Costs:
    """Time charged besides execution."""

    dispatch_s: float = 0.00141  # per exec action: cgroup writes + executor socket (docs/PERFORMANCE.md median)
    env_create_s: float = 1.0  # an AOE sandbox on a trajectory's first exec (docker create + start; assumed)
    # ``pytest -n W`` (W > 1) costs CPU to start its controller and each worker before any test runs: a fixed part
    # and, per worker, a share of the run's single-core work (each worker imports and collects the whole suite).
    # Fitted to five real PyPI suites on this machine (``loadtest.bench_suite_curves``, docs/EVALUATION.md): start
    # 0-1.48 s, median 0.33; share 0.012-0.27, median 0.185. Before that calibration (issue 15) the model was a
    # fixed 0.05 s + 0.22 s per worker, measured on one 20-module suite (``xdist_worker_cpu_s``, 0 now)
    xdist_start_cpu_s: float = 0.33
    xdist_worker_cpu_s: float = 0.0
    xdist_worker_share: float = 0.185
    # what a test run of more than one worker runs on (issue 36): "tangram", the elastic runner, or "xdist" (the
    # costs above, workers fixed at launch). The runner collects once (as plain pytest does: no cost beyond the
    # suite's own serial part) and forks its workers (milliseconds: not modelled); a malleable run's workers follow
    # its cores. What it costs besides is a share of the run's single-core work (coordination, reports):
    # ``runner_share``, assumed from the runner on one core against plain pytest (+3% lark, +12% of 0.4 s
    # pyflakes; loadtest/bench_runner.py, docs/EVALUATION.md) and varied in the sensitivity table
    test_runner: PytestRunner = "tangram"
    runner_share: float = 0.03
    h2d_gb_per_s: float = 25.0  # pinned host->GPU copy per GPU (PCIe 5 x16 in practice; assumed, unmeasured)
    evict_s: float = 0.05  # freeing a victim's GPU memory before a restore (assumed)
    # reading a host copy from a GPU node's local NVMe into pinned host memory (the disk tier, issue 18): one
    # PCIe 4 NVMe drive reads 3-7 GB/s sequentially; 3 assumed, unmeasured (scripts/gpu_check.py measures it)
    disk_gb_per_s: float = 3.0
    pod_start_s: float = 2.0  # a Kubernetes pod from bound to running (image present; assumed)
    pod_bind_per_s: float = 50.0  # pods the control plane binds per second (kube-scheduler's default API QPS)
    api_error_s: float = 0.5  # an upstream's 429 answer
    api_timeout_s: float = 600.0  # the client's timeout on an upstream call (paper §6.1)
    api_retries: int = 3  # retries after an error or a timeout (paper §6.1)
    api_backoff_s: float = 1.0  # wait before a retry

    def __post_init__(self) -> None:
        if self.test_runner not in TEST_RUNNERS:
            raise ValueError(f"costs.test_runner is {self.test_runner!r}; one of {', '.join(TEST_RUNNERS)}")


def startup_cpu_s(costs: Costs, workers: int, work_s: float, follows: bool = False) -> float:
    """CPU seconds a test run of ``work_s`` single-core seconds spends besides its tests with ``workers`` workers
    (``follows``: the runner's, following its cores, on one core too); none for plain pytest."""
    if costs.test_runner == "tangram":
        return costs.runner_share * work_s if workers > 1 or follows else 0.0
    if workers <= 1:
        return 0.0
    return costs.xdist_start_cpu_s + (costs.xdist_worker_cpu_s + costs.xdist_worker_share * work_s) * workers


@dataclass(frozen=True, slots=True)
class Cluster:
    cpu_nodes: int = 0
    cores_per_node: int = 256
    node_memory_mb: int = 2_400_000  # 2.4 TB per CPU node (paper §6.1)
    gpu_node_sizes: tuple[int, ...] = ()  # GPUs per GPU node
    gpu_memory_mb: int = 81_920  # per GPU
    gpu_host_memory_mb: int = 3_000_000  # 3 TB per GPU node (paper §6.1)
    gpu_disk_tier: bool = False  # host copies that do not fit host memory spill to local disk (issue 18)
    #: each GPU node's type, a name in ``gpu_types`` (issue 18); empty: every node the reference type (``h100``), on
    #: which the trace's durations are. The memory per GPU stays ``gpu_memory_mb`` whatever the type
    gpu_node_types: tuple[str, ...] = ()
    gpu_types: Mapping[str, GpuType] = field(default_factory=lambda: GPU_TYPES)
    services: tuple[ServiceModel, ...] = ()
    apis: tuple[ApiModel, ...] = ()
    costs: Costs = field(default_factory=Costs)
    static: StaticServing = field(default_factory=StaticServing)

    def __post_init__(self) -> None:
        if self.gpu_node_types and len(self.gpu_node_types) != len(self.gpu_node_sizes):
            raise ValueError(f"{len(self.gpu_node_types)} GPU node types for {len(self.gpu_node_sizes)} GPU nodes")
        unknown = sorted(set(self.gpu_node_types) - set(self.gpu_types))
        if unknown:
            raise ValueError(f"unknown GPU types {unknown}; known: {sorted(self.gpu_types)}")

    def gpu_node_type(self, index: int) -> str:
        return self.gpu_node_types[index] if self.gpu_node_types else REFERENCE_TYPE

    @property
    def cores(self) -> int:
        return self.cpu_nodes * self.cores_per_node

    @property
    def gpus(self) -> int:
        return sum(self.gpu_node_sizes)


def gpu_nodes(gpus: int, per_node: int = 8) -> tuple[int, ...]:
    """``gpus`` GPUs as full nodes of ``per_node`` and one smaller node for the rest."""
    full, rest = divmod(gpus, per_node)
    return (per_node,) * full + ((rest,) if rest else ())
