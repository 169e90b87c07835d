"""One CPU node as the CPU manager holds it: its cores, its memory budget, its sandbox backend, and whether it is
still in service."""

from __future__ import annotations

import asyncio

from managers.cores import CorePool
from managers.cpu_config import CpuNodeConfig
from sandboxes.backend import SandboxBackend


class CpuNode:
    """One node's cores, memory budget and sandbox backend."""

    def __init__(self, config: CpuNodeConfig, backend: SandboxBackend) -> None:
        """``config`` as resolved on the node's host: its cores, memory and NUMA groups (one group if none)."""
        self.name = config.name
        self.config = config
        self.backend = backend
        self.cores = CorePool(config.numa or (config.cores,))
        self.memory_mb = config.memory_mb
        self.memory_reserved = 0
        #: why the node is out of service (it left the Ray cluster); None while it serves
        self.lost: str | None = None
        #: set when the node is lost, for actions that lost touch with it to learn their fate
        self.gone = asyncio.Event()

    def lose(self, reason: str) -> None:
        self.lost = reason
        self.gone.set()

    def come_back(self, backend: SandboxBackend) -> None:
        self.backend, self.lost, self.gone = backend, None, asyncio.Event()

    def memory_load_after(self, memory_mb: int) -> float:
        return (self.memory_reserved + memory_mb) / self.memory_mb
