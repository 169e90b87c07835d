"""CPU manager via allocate-on-execution (paper §5.2).

One long-lived sandbox per trajectory keeps files and processes between actions and reserves memory for its whole
life, but holds no core while idle (it is frozen). Before each ``exec`` the sandbox is moved onto exactly the cores
the scheduler granted (cpuset plus a CPU quota of that many cores), the command runs through the in-sandbox
executor, and the cores return to the pool when it ends.

Pools are nodes: ``fit`` and the DP see free cores per node, never a global sum. A trajectory's first action picks
a node that has the cores now and the memory for the whole environment, balancing memory load; its later actions
stay there. Inside a node, cores come from one NUMA node when possible.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from managers.cores import CorePool, host_numa_nodes
from managers.cpu_config import CpuConfig, CpuNodeConfig, on_this_host
from managers.environment import Environment, EnvState
from managers.exec_spec import ExecSpec, ExecSpecBody, executor_request, parse_exec_spec
from managers.sandbox_backends import SandboxFactory, open_sandbox_backend
from sandboxes.backend import Leftover, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from tangram.core.action import Action, Kind, new_action_id
from tangram.core.errors import ActionFailed, Conflict, NotFound, TooMany, Unavailable, Unprocessable
from tangram.core.malleable import WorkerCost, workers_for
from tangram.core.seam import Allocation, Fit, Outcome, PoolStatus, ResourceManager

log = logging.getLogger("tangram.cpu")

RESOURCE = "cpu"
DEADLINE_MARGIN_S = 0.25  # the executor kills at the deadline minus this, so partial output comes back even
# when killing a large process tree (a fork bomb) takes a while


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


class CpuFit(Fit):
    """Free cores and memory per node for one scheduling pass, plus the nodes it chose for new trajectories."""

    def __init__(self, manager: CpuManager) -> None:
        self.manager = manager
        self.before = {name: len(node.cores.free) for name, node in manager.nodes.items()}
        self.free = dict(self.before)
        self.memory_free = {name: node.memory_mb - node.memory_reserved for name, node in manager.nodes.items()}
        self.new_trajectories: dict[tuple[str, str], str] = {}
        self.placed: dict[str, tuple[str, int, int]] = {}
        self.short_of_memory: set[str] = set()  # refused new environments that only lacked memory

    def try_add(self, action: Action, units: Mapping[str, int]) -> bool:
        n = units.get(RESOURCE, 0)
        key = self.manager.trajectory_key(action)
        node = self.manager.node_of(action) or (self.new_trajectories.get(key) if key else None)
        memory = 0
        if node is None:
            memory = self.manager.memory_for(action)
            candidates = [name for name in self.free if self.free[name] >= n and self.memory_free[name] >= memory]
            if not candidates:
                if any(free >= n for free in self.free.values()):
                    self.short_of_memory.add(action.id)
                return False
            node = min(candidates, key=lambda name: (self.memory_load_after(name, memory), -self.free[name]))
            if key:
                self.new_trajectories[key] = node
        elif self.free[node] < n:
            return False
        self.free[node] -= n
        self.memory_free[node] -= memory
        self.placed[action.id] = (node, n, memory)
        return True

    def holds_back(self, action: Action) -> bool:
        """A new trajectory waiting only for memory does not hold back actions of trajectories that have their
        environment: memory comes back when trajectories end, and holding them back would keep theirs from ending."""
        return action.id not in self.short_of_memory

    def memory_load_after(self, node: str, memory_mb: int) -> float:
        """Memory load of ``node`` if it also reserved ``memory_mb``, counting this pass's new trajectories."""
        capacity = self.manager.nodes[node].memory_mb
        return (capacity - self.memory_free[node] + memory_mb) / capacity

    def remove(self, action: Action) -> None:
        node, n, memory = self.placed.pop(action.id)
        self.free[node] += n
        self.memory_free[node] += memory
        key = self.manager.trajectory_key(action)
        if memory and key and self.new_trajectories.get(key) == node:
            del self.new_trajectories[key]

    def pool_of(self, action: Action, resource: str) -> str:
        return self.placed[action.id][0]

    def free_before(self, resource: str, pool: str) -> int:
        return self.before[pool]

    def lend(self, resource: str, pool: str, units: int) -> None:
        self.before[pool] += units
        self.free[pool] += units

    def pools(self, resource: str) -> Sequence[str]:
        return tuple(self.before)


#: a CPU allocation's handle: the environment it runs in (None: deleted since submit, the action fails at run),
#: its node and its cores
CpuHandle = tuple[Environment | None, str, tuple[int, ...]]


#: what a non-exec action holding cores reads as: no environment, image, memory or files of its own
NOT_EXEC = ExecSpec(command=())


class CpuManager(ResourceManager[CpuHandle]):
    name = "cpu"
    kinds = frozenset({Kind.EXEC})
    spec_types = MappingProxyType({Kind.EXEC: ExecSpecBody})

    def __init__(self, config: CpuConfig, open_backend: SandboxFactory = open_sandbox_backend) -> None:
        """``open_backend(node, config)`` opens a node's sandbox backend at ``start`` (by default its Docker
        engine, or local processes: ``managers/sandbox_backends.py``); ``add_node`` puts a node in service with
        one already made (the simulator's)."""
        self.config = replace(config, nodes=tuple(on_this_host(node) for node in config.nodes))
        self._open_backend = open_backend
        self.nodes: dict[str, CpuNode] = {}
        self.environments: dict[str, Environment] = {}
        self.by_trajectory: dict[tuple[str, str], Environment] = {}
        #: per task: its environments and the MiB they reserve (for per-task caps, tangram.tenants)
        self._task_environments: Counter[str] = Counter()
        self._task_memory_mb: Counter[str] = Counter()
        self._reaper: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        for node_config in self.config.nodes:
            backend = await self._open_backend(node_config, self.config)
            numa = node_config.numa or (host_numa_nodes(node_config.cores) if node_config.engine.startswith("unix")
                                        else [node_config.cores])
            leftovers = await backend.adopt(self.config.broker_id)
            node = CpuNode(node_config, backend, numa)
            self.add_node(node)
            for leftover in leftovers:
                await self._take_over(node, leftover)
            if leftovers:
                lost = sum(1 for leftover in leftovers if leftover.sandbox is None)
                log.warning("node %s: took over %d environment(s) a previous run of broker %r left (%d of them "
                            "lost)", node.name, len(leftovers), self.config.broker_id, lost)
        self._reaper = asyncio.create_task(self._reap_idle(), name="tangram-cpu-reaper")

    def add_node(self, node: CpuNode) -> None:
        """Put a node in service (``start`` does it for every configured node; the simulator, directly)."""
        self.nodes[node.name] = node

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        keep = self.config.keep_sandboxes_on_stop
        kept = [env for env in self.environments.values() if keep and env.state is EnvState.READY
                and not env.ephemeral]
        await asyncio.gather(*(self._destroy(env) for env in list(self.environments.values()) if env not in kept),
                             return_exceptions=True)
        if kept:
            log.warning("%d sandboxes kept for the next start of broker %r to adopt (cpu.keep_sandboxes_on_stop)",
                        len(kept), self.config.broker_id)
        for node in self.nodes.values():
            if not keep:
                try:  # also the containers no environment knows any more (a removal the engine missed while down)
                    await node.backend.reap(self.config.broker_id)
                except SandboxError as error:
                    log.warning("node %s: leftover sandboxes not reaped at stop (%s)", node.name, error)
            await node.backend.close()

    async def _reap_idle(self) -> None:
        """Destroy environments idle past the TTL (and pending ones whose action never came)."""
        period = min(5.0, self.config.idle_ttl_s / 2)
        while True:
            await asyncio.sleep(period)
            now = time.time()
            for env in list(self.environments.values()):
                if not env.running and env.creating is None and now - env.last_used > self.config.idle_ttl_s:
                    log.info("environment %s idle for %.0f s: destroyed", env.id, now - env.last_used)
                    try:
                        await self._destroy(env)
                    except Exception:  # keep reaping the others
                        log.exception("destroying %s failed", env.id)

    # -- the scheduler's view -------------------------------------------------------------------------------

    @property
    def resources(self) -> Mapping[str, int]:
        return {RESOURCE: sum(node.cores.capacity for node in self.nodes.values())}

    def largest_pool(self, resource: str) -> int:
        return max(node.cores.capacity for node in self.nodes.values())

    def fit(self) -> CpuFit:
        return CpuFit(self)

    def exec_spec(self, action: Action) -> ExecSpec:
        """The action's spec, parsed on first use (at submit) and kept on the action. Another kind that also
        demands cores (a reward action may) has no exec spec: it reads as one with every field absent."""
        if action.kind is not Kind.EXEC:
            return NOT_EXEC
        if not isinstance(action.parsed_spec, ExecSpec):
            action.parsed_spec = parse_exec_spec(action.spec, self.config.limits)
        return action.parsed_spec

    def trajectory_key(self, action: Action) -> tuple[str, str] | None:
        if self.exec_spec(action).environment is None and action.trajectory is not None:
            return action.task, action.trajectory
        return None

    def environment_of(self, action: Action) -> Environment | None:
        env_id = self.exec_spec(action).environment
        if env_id is not None:
            return self.environments.get(env_id)
        key = self.trajectory_key(action)
        return self.by_trajectory.get(key) if key else None

    def node_of(self, action: Action) -> str | None:
        env = self.environment_of(action)
        return env.node if env is not None else None

    def memory_for(self, action: Action) -> int:
        return self.exec_spec(action).memory_mb or self.config.default_memory_mb

    def environment_demand(self, action: Action) -> int | None:
        """MiB of the environment ``action`` would create if it started now; None if it runs in an existing one (or
        names one, which must exist)."""
        if action.kind is not Kind.EXEC or self.exec_spec(action).environment is not None:
            return None
        return self.memory_for(action) if self.environment_of(action) is None else None

    def task_usage(self, task: str) -> tuple[int, int]:
        """The task's environments and the MiB they reserve."""
        return self._task_environments[task], self._task_memory_mb[task]

    def holds_environment(self, task: str, trajectory: str) -> bool:
        return (task, trajectory) in self.by_trajectory

    def validate(self, action: Action) -> None:
        if action.kind is not Kind.EXEC:
            return
        if RESOURCE not in action.demands:
            raise Unprocessable("demand.cpu", 'exec actions run on cores: add "cpu": 1 (or a range) to demand')
        spec = self.exec_spec(action)
        if spec.environment is not None:
            env = self.environments.get(spec.environment)
            if env is None or env.task != action.task:
                raise NotFound("spec.environment", f"task {action.task!r} has no environment {spec.environment!r}")
            if env.state is EnvState.LOST:
                raise Conflict("spec.environment", f"environment {env.id} is lost ({env.lost_reason}); delete it "
                                                   f"and create another")
            return
        self._check_memory(spec.memory_mb, "spec.memory_mb")
        if self.environment_of(action) is None:
            self._check_room("spec")

    def _check_memory(self, memory_mb: int | None, field: str) -> int:
        """The memory a new environment reserves; 422 when no node could ever hold it."""
        memory = memory_mb or self.config.default_memory_mb
        largest = max(node.memory_mb for node in self.nodes.values())
        if memory > largest:
            raise Unprocessable(field, f"{memory} MiB is more than any node offers ({largest} MiB)")
        return memory

    def _check_room(self, field: str) -> None:
        if len(self.environments) >= self.config.max_environments:
            raise TooMany(field, f"the broker holds {len(self.environments)} environments, its limit; delete "
                                 f"idle ones or wait for their TTL")

    def allocate(self, action: Action, units: Mapping[str, int], pools: Mapping[str, str]) -> Allocation[CpuHandle]:
        node = self.nodes[pools[RESOURCE]]
        env = self.environment_of(action)
        spec = self.exec_spec(action)
        if env is None and spec.environment is not None:  # deleted since submit: fails at run
            cores = node.cores.take(units[RESOURCE])
            return Allocation(action.id, dict(units), dict(pools), handle=(None, node.name, cores))
        if env is None:
            env = self._reserve(action.task, action.trajectory, node, spec.image or self.config.default_image,
                                self.memory_for(action), dict(spec.files), ephemeral=action.trajectory is None)
        elif env.node != node.name:
            raise RuntimeError(f"environment {env.id} lives on {env.node}, not {node.name}")
        cores = node.cores.take(units[RESOURCE])
        placement = {"node": node.name, "cores": list(cores), "numa_nodes": node.cores.numa_of(cores),
                     "environment": env.id}
        return Allocation(action.id, dict(units), dict(pools), placement={RESOURCE: placement},
                          handle=(env, node.name, cores))

    def resizable(self, resource: str) -> bool:
        return resource == RESOURCE and self.config.malleable

    def workers(self, action: Action, resource: str, units: int, expected_s: float,
                learned: WorkerCost | None = None) -> int:
        """``workers_for`` at the learned worker cost, else at ``worker_start_s`` of CPU per worker, shared by the
        starting cores."""
        cap = min(action.demands[resource].max, self.largest_pool(resource))
        cost = learned or WorkerCost(self.config.worker_start_s / units)
        return workers_for(units, cap, expected_s, cost, self.config.worker_overhead)

    def resize(self, allocation: Allocation[CpuHandle], resource: str, units: int) -> None:
        if allocation.released:
            raise RuntimeError(f"resize of released allocation {allocation.action_id}")
        env, node_name, cores = allocation.held()
        pool = self.nodes[node_name].cores
        cores = pool.shrink(cores, units) if units < len(cores) else pool.grow(cores, units - len(cores))
        allocation.handle = (env, node_name, cores)
        allocation.units[resource] = units
        if RESOURCE in allocation.placement:
            allocation.placement[RESOURCE] = {**allocation.placement[RESOURCE], "cores": list(cores),
                                              "numa_nodes": pool.numa_of(cores)}

    async def apply_resize(self, allocation: Allocation[CpuHandle]) -> None:
        """Move the sandbox onto the union of its actions' cores and re-pin this action's command. An action whose
        command has not started yet (its sandbox is being created) or has ended is left alone: ``execute`` reads
        the allocation's cores when it starts the command."""
        env, _, cores = allocation.held()
        if env is None or allocation.released or env.sandbox is None:
            return
        async with env.lock:
            if allocation.action_id not in env.running:
                return
            env.running[allocation.action_id] = cores
            try:
                await env.sandbox.set_cores(env.union_cores())
                await env.sandbox.set_action_cores(allocation.action_id, frozenset(cores))
            except SandboxError as error:
                if error.lost:
                    self._mark_lost(env, error.message)
                raise ActionFailed("resize_failed", f"moving the command onto cores {list(cores)} failed: "
                                                    f"{error.message}", environment=env.id) from None

    def release(self, allocation: Allocation[CpuHandle]) -> None:
        if allocation.released or allocation.handle is None:
            return
        allocation.released = True
        _, node, cores = allocation.handle
        self.nodes[node].cores.give_back(cores)

    def status(self) -> list[PoolStatus]:
        rows = []
        for node in self.nodes.values():
            envs = [e for e in self.environments.values() if e.node == node.name]
            rows.append(PoolStatus(RESOURCE, node.name, node.cores.capacity, node.cores.in_use,
                                   extra={**node.backend.describe(), "numa": [list(g) for g in node.cores.numa],
                                          "free_cores": sorted(node.cores.free)}))
            rows.append(PoolStatus("memory_mb", node.name, node.memory_mb, node.memory_reserved,
                                   extra={"environments": len(envs)}))
        return rows

    # -- environments ---------------------------------------------------------------------------------------

    def _reserve(self, task: str, trajectory: str | None, node: CpuNode, image: str, memory_mb: int,
                 files: dict[str, bytes], *, ephemeral: bool) -> Environment:
        env = Environment(id="env-" + new_action_id(), task=task, trajectory=trajectory, node=node.name,
                          image=image, memory_mb=memory_mb, files=files, ephemeral=ephemeral)
        self._register(env)
        return env

    def _register(self, env: Environment) -> None:
        self.nodes[env.node].memory_reserved += env.memory_mb
        self.environments[env.id] = env
        self._task_environments[env.task] += 1
        self._task_memory_mb[env.task] += env.memory_mb
        if env.trajectory is not None:
            self.by_trajectory[(env.task, env.trajectory)] = env

    async def _take_over(self, node: CpuNode, leftover: Leftover) -> None:
        """A previous run's environment becomes this run's under its old id: its trajectory's next action finds
        its files and processes, or, if it was lost, an ``environment_lost`` error saying why. Its memory counts
        even past today's node size: the sandbox uses it whatever the config says now."""
        key = (leftover.task, leftover.trajectory) if leftover.trajectory is not None else None
        if leftover.env_id in self.environments or (key is not None and key in self.by_trajectory):
            if leftover.sandbox is not None:  # two sandboxes claim one trajectory: keep the first
                await leftover.sandbox.destroy()
            return
        env = Environment(id=leftover.env_id, task=leftover.task, trajectory=leftover.trajectory, node=node.name,
                          image=leftover.image, memory_mb=leftover.memory_mb, created_at=leftover.created_at,
                          sandbox=leftover.sandbox)
        if leftover.sandbox is not None:
            env.state = EnvState.READY
        else:
            self._mark_lost(env, leftover.lost_reason or "the broker restarted and the sandbox was gone")
        self._register(env)

    async def _sandbox(self, env: Environment) -> Sandbox:
        """The environment's sandbox, created on first use; concurrent first actions share one creation."""
        if env.sandbox is not None and env.state is EnvState.READY:
            return env.sandbox
        if env.state is EnvState.LOST:
            raise ActionFailed("environment_lost", f"environment {env.id} is lost: {env.lost_reason}; delete it "
                                                   f"(DELETE /v1/environments/{env.id}) and start another")
        if env.state is EnvState.DESTROYED:
            raise ActionFailed("environment_destroyed", f"environment {env.id} was destroyed")
        if env.creating is None:
            env.creating = asyncio.create_task(self._create(env), name=f"tangram-create-{env.id}")
            # its error is read by every waiter; when all were cancelled, nobody would, and asyncio would log it
            env.creating.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            return await asyncio.shield(env.creating)
        except SandboxError as error:
            raise ActionFailed(error.code, error.message, environment=env.id) from None

    async def _create(self, env: Environment) -> Sandbox:
        node = self.nodes[env.node]
        spec = SandboxSpec(env_id=env.id, task=env.task, trajectory=env.trajectory, image=env.image,
                           memory_mb=env.memory_mb, pids_limit=self.config.pids_limit, files=env.files,
                           broker_id=self.config.broker_id, read_only_root=self.config.read_only_root,
                           ephemeral=env.ephemeral, created_at=env.created_at)
        try:
            sandbox = await node.backend.create(spec)
        except BaseException:
            await self._destroy(env)  # frees the memory; the next action of the trajectory may try again
            raise
        finally:
            env.creating = None
        env.files = {}
        if env.state is EnvState.DESTROYED:  # deleted while being created
            await sandbox.destroy()
            raise SandboxError("environment_destroyed", f"environment {env.id} was deleted while being created")
        env.sandbox = sandbox
        env.state = EnvState.READY
        return sandbox

    async def _destroy(self, env: Environment) -> None:
        """Forget the environment (its memory and cores return at once) and remove its sandbox. A sandbox the
        engine cannot remove now (the engine is down) is logged; the next start's reaping removes it."""
        sandbox = self.detach(env)
        if sandbox is not None:
            try:
                await sandbox.destroy()
            except SandboxError as error:
                log.warning("environment %s: sandbox not removed (%s); the next start reaps it", env.id, error)

    def detach(self, env: Environment) -> Sandbox | None:
        """Forget ``env`` and free its memory reservation at once; returns its sandbox for the caller to destroy
        (None if it had none or was already detached)."""
        if env.state is EnvState.DESTROYED:
            return None
        env.state = EnvState.DESTROYED
        self.environments.pop(env.id, None)
        if env.trajectory is not None and self.by_trajectory.get((env.task, env.trajectory)) is env:
            del self.by_trajectory[(env.task, env.trajectory)]
        self.nodes[env.node].memory_reserved -= env.memory_mb
        self._task_environments[env.task] -= 1
        self._task_memory_mb[env.task] -= env.memory_mb
        if not self._task_environments[env.task]:
            del self._task_environments[env.task], self._task_memory_mb[env.task]
        return env.sandbox

    def _mark_lost(self, env: Environment, reason: str) -> None:
        log.warning("environment %s lost: %s", env.id, reason)
        env.state = EnvState.LOST
        env.lost_reason = reason

    async def create_environment(self, task: str, trajectory: str | None, image: str | None,
                                 memory_mb: int | None, files: dict[str, bytes],
                                 admit: Callable[[int], None] | None = None) -> Environment:
        """``POST /v1/environments``: place by memory load, create the sandbox now, report errors as 4xx.
        ``admit(memory_mb)`` may refuse (raise) once the request is known to be valid, before anything is reserved
        (the per-task caps)."""
        if trajectory is not None and (task, trajectory) in self.by_trajectory:
            existing = self.by_trajectory[(task, trajectory)]
            raise Conflict("trajectory", f"trajectory {trajectory!r} of task {task!r} already has environment "
                                         f"{existing.id}")
        self._check_room("environments")
        memory = self._check_memory(memory_mb, "memory_mb")
        if admit is not None:
            admit(memory)
        fitting = [n for n in self.nodes.values() if n.memory_reserved + memory <= n.memory_mb]
        if not fitting:
            raise TooMany("memory_mb", f"no node has {memory} MiB unreserved now; delete idle environments or "
                                       f"retry later")
        node = min(fitting, key=lambda n: (n.memory_load_after(memory), -len(n.cores.free)))
        env = self._reserve(task, trajectory, node, image or self.config.default_image, memory, files,
                            ephemeral=False)
        try:
            await self._sandbox(env)
        except ActionFailed as failure:
            refused = Unprocessable if failure.code in ("image_not_found", "image_without_python3") else Unavailable
            raise refused("image", failure.message, code=failure.code) from None
        return env

    def get_environment(self, env_id: str) -> Environment:
        env = self.environments.get(env_id)
        if env is None:
            raise NotFound("id", f"no environment {env_id!r}")
        return env

    async def delete_environment(self, env_id: str) -> Environment:
        env = self.get_environment(env_id)
        if env.running:
            raise Conflict("id", f"environment {env_id} runs {len(env.running)} action(s); cancel them first")
        await self._destroy(env)
        return env

    # -- execution ------------------------------------------------------------------------------------------

    async def execute(self, action: Action, allocation: Allocation[CpuHandle]) -> Outcome:
        env = allocation.held()[0]
        if env is None:
            raise ActionFailed("environment_destroyed", f"environment {self.exec_spec(action).environment} was "
                                                        f"deleted after this action was submitted")
        spec = self.exec_spec(action)
        setup_started = time.perf_counter()
        try:
            sandbox = await self._sandbox(env)
            setup_s = time.perf_counter() - setup_started
            remaining = action.submitted_at + action.timeout_s - time.time() - DEADLINE_MARGIN_S
            try:
                async with env.lock:
                    cores = allocation.held()[2]  # as resized while the sandbox was being created
                    env.running[action.id] = cores
                    await sandbox.set_cores(env.union_cores())
                workers = action.malleable.workers if action.malleable is not None else None
                request = executor_request(spec, cores, max(remaining, 0.001), sandbox.workdir,
                                           {"TANGRAM_ACTION_ID": action.id}, workers=workers, tag=action.id)
                response = await sandbox.run(request)
            except SandboxError as error:
                if error.lost:
                    self._mark_lost(env, error.message)
                raise ActionFailed(error.code, error.message, environment=env.id) from None
            finally:
                env.running.pop(action.id, None)
                env.last_used = time.time()
                if env.state is EnvState.READY:
                    await self._settle(env, sandbox)
        finally:
            if env.ephemeral and not env.running:
                await self._destroy(env)
        return Outcome(self._result(response, env, allocation.held()[2], setup_s))

    async def _settle(self, env: Environment, sandbox: Sandbox) -> None:
        """Shrink the sandbox to the cores still in use, or freeze it, before the cores go back to the pool."""
        try:
            async with env.lock:
                await sandbox.set_cores(env.union_cores())
        except SandboxError as error:
            self._mark_lost(env, error.message)

    def _result(self, response: dict[str, Any], env: Environment, cores: tuple[int, ...],
                setup_s: float) -> dict[str, Any]:
        output = {k: response.get(k) for k in ("exit_code", "signal", "stdout", "stderr", "stdout_bytes",
                                               "stderr_bytes", "stdout_truncated", "stderr_truncated",
                                               "duration_s")}
        where = {"environment": env.id, "node": env.node, "cores": list(cores), "setup_s": round(setup_s, 6)}
        if response.get("error"):
            raise ActionFailed("exec_error", response["error"], **where)
        if response.get("timed_out"):
            raise ActionFailed("timed_out", "the command ran past the action's deadline; it was killed with its "
                                            "whole process tree", **output, **where)
        if response.get("oom_killed"):
            raise ActionFailed("out_of_memory", f"the command exceeded the environment's memory limit "
                                                f"({env.memory_mb} MiB) and was killed; the environment is still "
                                                f"usable", **output, **where)
        return {**output, **where}
