"""One CPU node as the CPU manager holds it: its cores, its memory and sandbox budgets, its sandbox backend, and
whether it is still in service."""

from __future__ import annotations

from managers.cpu.config import CpuNodeConfig
from managers.cpu.cores import CorePool
from managers.remote.broker.node_standing import NodeStanding
from sandboxes.backend import SandboxBackend

#: the resource the CPU manager owns: cores
RESOURCE = "cpu"


class CpuNode(NodeStanding):
    """One node's cores, memory budget, sandbox budget and sandbox backend."""

    def __init__(self, config: CpuNodeConfig, backend: SandboxBackend, sandboxes: int | None = None) -> None:
        """``config`` as resolved on the node's host: its cores, memory and NUMA groups (one group if none);
        ``sandboxes``: the environments its pids budget holds (None: no budget)."""
        super().__init__()
        self.name = config.name
        self.config = config
        self.backend = backend
        self.cores = CorePool(config.numa or (config.cores,))
        self.memory_mb = config.memory_mb
        self.memory_reserved = 0
        self.sandboxes = sandboxes
        self.environments = 0

    def come_back(self, backend: SandboxBackend) -> None:
        self.backend = backend
        self.returned()

    def memory_load_after(self, memory_mb: int) -> float:
        return (self.memory_reserved + memory_mb) / self.memory_mb

    def lacks_image(self, image: str) -> bool:
        """Whether a new environment of ``image`` here would wait for a pull first, as its backend last saw (False
        where it cannot say), so that node choice prefers nodes holding it."""
        return self.backend.holds_image(image) is False

    @property
    def sandbox_room(self) -> int | None:
        """How many more environments its pids budget holds (None: no budget)."""
        return None if self.sandboxes is None else self.sandboxes - self.environments

    def has_room_for(self, environments: int = 1) -> bool:
        """Whether its pids budget holds ``environments`` more."""
        return self.sandboxes is None or self.environments + environments <= self.sandboxes
