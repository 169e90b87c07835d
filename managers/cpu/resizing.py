"""Cores of a running command change while it runs: the CPU side of malleable actions (``tangram/core/malleable.py``).

The books change at once (the node's core pool) and the sandbox is moved onto the new cores after (``apply``), so a
shrink frees its cores for the next allocation in the same pass and the running command is re-pinned off them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from managers.cpu.environment import CpuHandle, LossCause
from managers.cpu.exec_spec import runs_pytest
from managers.cpu.node import RESOURCE
from sandboxes.backend import SandboxError
from tangram.core.action import Action
from tangram.core.errors import ActionFailed
from tangram.core.malleable import WorkerCost, Workers, workers_for
from tangram.core.seam import Allocation, Resizing

if TYPE_CHECKING:
    from managers.cpu.manager import CpuManager



class CpuResizing(Resizing[CpuHandle]):
    def __init__(self, manager: CpuManager) -> None:
        self.manager = manager

    def workers(self, action: Action, units: int, expected_s: float, learned: WorkerCost | None = None) -> Workers:
        """A pytest run the elastic runner takes follows its cores up to the action's maximum (the runner forks a
        worker for each core added: none is started ahead). Any other command gets ``workers_for`` at the learned
        worker cost, else at ``worker_start_s`` of CPU per worker, shared by the starting cores."""
        config = self.manager.config
        cap = min(action.demands[RESOURCE].max, self.manager.largest_pool(RESOURCE))
        if config.pytest_runner == "tangram" and runs_pytest(self.manager.exec_spec(action)):
            return Workers(max(units, cap), follows=True)
        cost = learned or WorkerCost(config.worker_start_s / units)
        return Workers(workers_for(units, cap, expected_s, cost, config.worker_overhead))

    def resize(self, allocation: Allocation[CpuHandle], units: int) -> None:
        if allocation.released:
            raise RuntimeError(f"resize of released allocation {allocation.action_id}")
        env, node_name, cores = allocation.held()
        pool = self.manager.nodes[node_name].cores
        cores = pool.shrink(cores, units) if units < len(cores) else pool.grow(cores, units - len(cores))
        allocation.handle = (env, node_name, cores)
        allocation.units[RESOURCE] = units
        if RESOURCE in allocation.placement:
            allocation.placement[RESOURCE] = {**allocation.placement[RESOURCE], "cores": list(cores),
                                              "numa_nodes": pool.numa_of(cores)}

    async def apply(self, allocation: Allocation[CpuHandle]) -> None:
        """Move this action's command onto its new cores (its sandbox widens or narrows with it). An action whose
        command has not started yet (its sandbox is being created) or has ended is left alone: ``execute`` reads
        the allocation's cores when it starts the command."""
        env, _, cores = allocation.held()
        if env is None or allocation.released or env.sandbox is None or allocation.action_id not in env.running:
            return
        try:
            await env.sandbox.repin(allocation.action_id, frozenset(cores))
        except SandboxError as error:
            if error.lost:
                self.manager.environments.mark_lost(env, LossCause.SANDBOX_DIED, error.message)
            raise ActionFailed("resize_failed", f"moving the command onto cores {list(cores)} failed: "
                                                f"{error.message}", environment=env.id) from None
