"""Which GPUs this host has, from NVML (pynvml): the GPU manager's default node when none is configured."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

log = logging.getLogger("tangram.gpu")


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mb: int


@functools.cache
def discover_gpus() -> tuple[GpuInfo, ...]:
    """This host's GPUs; empty when NVML is missing or finds no driver (a CPU-only machine), never an error."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        log.debug("no NVIDIA driver: %s", error)
        return ()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total >> 20
            gpus.append(GpuInfo(index, name.decode() if isinstance(name, bytes) else name, memory))
        return tuple(gpus)
    finally:
        pynvml.nvmlShutdown()
