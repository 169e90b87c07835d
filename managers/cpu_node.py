"""One CPU node as the CPU manager holds it: its cores, its memory budget and its sandbox backend."""

from __future__ import annotations

from collections.abc import Sequence

from managers.cores import CorePool
from managers.cpu_config import CpuNodeConfig
from sandboxes.backend import SandboxBackend


class CpuNode:
    """One node's cores, memory budget and sandbox backend."""

    def __init__(self, config: CpuNodeConfig, backend: SandboxBackend, numa: Sequence[Sequence[int]]) -> None:
        self.name = config.name
        self.config = config
        self.backend = backend
        self.cores = CorePool(numa)
        self.memory_mb = config.memory_mb
        self.memory_reserved = 0

    def memory_load_after(self, memory_mb: int) -> float:
        return (self.memory_reserved + memory_mb) / self.memory_mb
