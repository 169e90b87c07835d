"""GPU types (HetRL's device labels) and the speed model a placement over them starts from.

A node's ``type`` names a spec: dense BF16 TFLOPS, HBM bandwidth, host-to-device bandwidth and memory. The model
is a prior from those four figures, to be refined later by measured durations per type: a service is compute-bound
when it only scores (prefill) and memory-bound when it generates (decode), and its speed on a type relative to the
reference type is the ratio of their TFLOPS or of their HBM bandwidths accordingly; a restore's time scales with
the host-to-device bandwidth; an instance fits a type only if its memory per GPU fits the type's. The degree of
parallelism is left to the service's efficiency curve, which the type's factor multiplies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StrictInt

from tangram.core.config_tables import TABLE, table
from tangram.core.errors import ConfigError
from tangram.core.names import NAME

#: a figure above its cap is in the wrong unit (bytes/s for GB/s, bytes for MB)
Tflops = Annotated[float, Strict(), Field(gt=0, le=100_000)]
GbPerS = Annotated[float, Strict(), Field(gt=0, le=100_000)]
MemoryMb = Annotated[StrictInt, Field(ge=1, le=100_000_000)]

#: what limits a service's speed: arithmetic (prefill) or memory bandwidth (decode)
Bound = Literal["compute", "memory"]


@dataclass(frozen=True)
class GpuType:
    """One ``[gpu.types.NAME]`` table: a GPU's nominal figures, the inputs of the speed model."""

    __pydantic_config__ = TABLE

    tflops: Tflops  # dense BF16 tensor TFLOPS (datasheets also print twice this, "with sparsity")
    hbm_gb_per_s: GbPerS  # device memory bandwidth
    h2d_gb_per_s: GbPerS  # host-to-device copy bandwidth, one direction
    memory_mb: MemoryMb  # device memory, MiB (GiB x 1024)


#: Shipped types: nominal figures from the vendors' datasheets (NVIDIA H100, H200, H20, A100, L40S and A10
#: datasheets; host-to-device is the PCIe link's nominal one-way rate: Gen5 x16 64 GB/s, Gen4 x16 32 GB/s). Measured
#: figures are lower (a pinned copy reaches ~80% of the link); only their ratios matter to the model.
GPU_TYPES: Mapping[str, GpuType] = {
    "h100": GpuType(tflops=989, hbm_gb_per_s=3350, h2d_gb_per_s=64, memory_mb=80 * 1024),  # H100 SXM5 80GB
    "h200": GpuType(tflops=989, hbm_gb_per_s=4800, h2d_gb_per_s=64, memory_mb=141 * 1024),  # H200 SXM 141GB
    "h20": GpuType(tflops=148, hbm_gb_per_s=4000, h2d_gb_per_s=64, memory_mb=96 * 1024),  # H20 96GB
    "a100": GpuType(tflops=312, hbm_gb_per_s=2039, h2d_gb_per_s=32, memory_mb=80 * 1024),  # A100 SXM4 80GB
    "l40s": GpuType(tflops=362, hbm_gb_per_s=864, h2d_gb_per_s=32, memory_mb=48 * 1024),  # L40S 48GB GDDR6
    "a10": GpuType(tflops=125, hbm_gb_per_s=600, h2d_gb_per_s=32, memory_mb=24 * 1024),  # A10 24GB GDDR6
    # virtual GPUs on the CPU (tests, CI): a few cores against DDR memory, a memcpy for a restore; the node's
    # gpu_memory_mb budget, not this, is what bounds them
    "cpu": GpuType(tflops=1, hbm_gb_per_s=50, h2d_gb_per_s=10, memory_mb=64 * 1024),
}

#: the type the speeds are relative to, and a CUDA node's type when its table names none: an untyped cluster is a
#: homogeneous one, where every speed is 1 and a placement is the type-blind one
REFERENCE_TYPE = "h100"


def merge_types(raw: Any, where: str = "gpu.types") -> dict[str, GpuType]:
    """The shipped types with a config's ``[gpu.types.NAME]`` tables merged in: a table for a shipped type overrides
    the fields it gives, a new name must give every field. A bad table is a ``ConfigError`` naming the field."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "must be a table of GPU types")
    types = dict(GPU_TYPES)
    for name, body in raw.items():
        if not NAME.match(name):
            raise ConfigError(f"{where}.{name}", "is not a valid type name (letters, digits and ._:-/)")
        if not isinstance(body, dict):
            raise ConfigError(f"{where}.{name}", "must be a table")
        shipped = asdict(types[name]) if name in types else {}
        types[name] = table(GpuType, {**shipped, **body}, f"{where}.{name}")
    return types


def speed(kind: GpuType, reference: GpuType, bound: Bound) -> float:
    """How many times faster a service with this ``bound`` runs on ``kind`` than on ``reference``."""
    if bound == "compute":
        return kind.tflops / reference.tflops
    return kind.hbm_gb_per_s / reference.hbm_gb_per_s


def bound_of(task: str) -> Bound:
    """A service task's bound: generating text is decode (memory-bound); the others score a prompt (prefill)."""
    return "memory" if task == "generate" else "compute"


def restore_factor(kind: GpuType, reference: GpuType) -> float:
    """A restore's time on ``kind`` over its time on ``reference``: a host-to-device copy of the same weights."""
    return reference.h2d_gb_per_s / kind.h2d_gb_per_s


def fits(kind: GpuType, gpu_memory_mb: float) -> bool:
    """Whether an instance needing ``gpu_memory_mb`` on each of its GPUs fits a GPU of this type."""
    return gpu_memory_mb <= kind.memory_mb
