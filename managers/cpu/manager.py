"""CPU manager via allocate-on-execution (paper §5.2).

One long-lived sandbox per trajectory keeps files and processes between actions and reserves memory for its whole
life, but holds no core while idle (it is frozen). Before each ``exec`` the sandbox is moved onto exactly the cores
the scheduler granted (cpuset plus a CPU quota of that many cores), the command runs through the in-sandbox
executor, and the cores return to the pool when it ends.

Pools are nodes: ``fit`` and the DP see free cores per node, never a global sum. A trajectory's first action picks
a node that has the cores now and the memory for the whole environment, balancing memory load; its later actions
stay there. Inside a node, cores come from one NUMA node when possible. The environments themselves (reserving,
creating, reaping, taking over after a restart) are ``managers/cpu/environments.py``'s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from prometheus_client import Counter as MetricCounter

from managers.cpu.action_result import action_result
from managers.cpu.config import CpuConfig, CpuNodeConfig, on_this_host
from managers.cpu.environment import CpuHandle, Environment, EnvState, LossCause
from managers.cpu.environment_files import alone
from managers.cpu.environments import Environments
from managers.cpu.exec_spec import ExecSpec, ExecSpecBody, exec_request, parse_exec_spec, runner_report
from managers.cpu.live_output import LiveOutputs
from managers.cpu.long_tests import LongTests, long_tests_from
from managers.cpu.node import RESOURCE, CpuNode
from managers.cpu.resizing import CpuResizing
from managers.cpu.sandbox_backends import SandboxFactory, open_sandbox_backend, warm_kinds
from sandboxes.backend import NODE_UNAVAILABLE, Leftover, SandboxBackend, SandboxError, sandbox_owner
from sandboxes.file_wire import WriteFiles
from tangram.core.action import Action, Kind
from tangram.core.errors import ActionFailed, Conflict, NotFound, Unprocessable
from tangram.core.fencing import current
from tangram.core.seam import Allocation, CyclePlugins, Fit, MetricsRegistry, Outcome, PoolStatus, ResourceManager

if TYPE_CHECKING:
    from managers.remote.broker.ray_membership import RayMembership

log = logging.getLogger("tangram.cpu")

DEADLINE_MARGIN_S = 0.25  # the executor kills at the deadline minus this, so partial output comes back even
# when killing a large process tree (a fork bomb) takes a while


class CpuFit(Fit):
    """Free cores, memory and sandbox room per node for one scheduling pass, plus the nodes it chose for new
    trajectories."""

    def __init__(self, manager: CpuManager) -> None:
        self.manager = manager
        self.before = {name: len(node.cores.free) for name, node in manager.nodes.items()}
        self.free = dict(self.before)
        self.memory_free = {name: node.memory_mb - node.memory_reserved for name, node in manager.nodes.items()}
        #: environments this pass places on each node, against its pids budget
        self.new_environments: Counter[str] = Counter()
        #: nodes that may take new environments (a lost node's cores serve only the actions that fail there)
        self.serving = tuple(name for name, node in manager.nodes.items() if node.lost is None)
        self.new_trajectories: dict[tuple[str, str], str] = {}
        self.placed: dict[str, tuple[str, int, int]] = {}
        self.short_of_memory: set[str] = set()  # refused new environments that only lacked memory or pids

    def try_add(self, action: Action, units: Mapping[str, int]) -> bool:
        n = units.get(RESOURCE, 0)
        key = self.manager.trajectory_key(action)
        node = self.manager.node_of(action) or (self.new_trajectories.get(key) if key else None)
        memory = 0
        if node is None:
            memory = self.manager.memory_for(action)
            candidates = [name for name in self.serving if self.free[name] >= n and self.memory_free[name] >= memory
                          and self.manager.nodes[name].has_room_for(self.new_environments[name] + 1)]
            if not candidates:
                if any(free >= n for free in self.free.values()):
                    self.short_of_memory.add(action.id)
                return False
            image = self.manager.exec_spec(action).image or self.manager.config.default_image
            locality = self.manager.config.images.locality
            node = min(candidates, key=lambda name: (self.memory_load_after(name, memory) + locality
                                                     * self.manager.nodes[name].lacks_image(image), -self.free[name]))
            if key:
                self.new_trajectories[key] = node
        elif self.free[node] < n:
            return False
        self.free[node] -= n
        self.memory_free[node] -= memory
        self.new_environments[node] += 1 if memory else 0
        self.placed[action.id] = (node, n, memory)
        return True

    def holds_back(self, action: Action) -> bool:
        """A new trajectory waiting only for memory (or sandbox room) does not hold back actions of trajectories
        that have their environment: both come back when trajectories end, and holding them back would keep theirs
        from ending."""
        return action.id not in self.short_of_memory

    def memory_load_after(self, node: str, memory_mb: int) -> float:
        """Memory load of ``node`` if it also reserved ``memory_mb``, counting this pass's new trajectories."""
        capacity = self.manager.nodes[node].memory_mb
        return (capacity - self.memory_free[node] + memory_mb) / capacity

    def remove(self, action: Action) -> None:
        node, n, memory = self.placed.pop(action.id)
        self.free[node] += n
        self.memory_free[node] += memory
        self.new_environments[node] -= 1 if memory else 0
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


#: what a non-exec action holding cores reads as: no environment, image, memory or files of its own
NOT_EXEC = ExecSpec(command=())


class CpuManager(ResourceManager[CpuHandle]):
    name = "cpu"
    kinds = frozenset({Kind.EXEC})
    spec_types = MappingProxyType({Kind.EXEC: ExecSpecBody})

    def __init__(self, config: CpuConfig, open_backend: SandboxFactory = open_sandbox_backend) -> None:
        """``open_backend(node, config)`` opens a node's sandbox backend at ``start`` (by default its Docker
        engine, or local processes: ``managers/cpu/sandbox_backends.py``); ``add_node`` puts a node in service with
        one already made (the simulator's)."""
        self.config = replace(config, nodes=tuple(on_this_host(node) for node in config.nodes))
        self._open_backend = open_backend
        self.nodes: dict[str, CpuNode] = {}
        self.environments = Environments(self.config, self.nodes)
        self._membership: RayMembership | None = None
        self.pytest_runs = MetricCounter("tangram_pytest_runs", "Elastic pytest runs rewritten to the runner, by what "
                                         "ran: tangram (forked workers), plain (its fallback, with its reason in the "
                                         "record) or unknown (its line missing from the output)", ["runner"],
                                         registry=None)
        self.long_tests = LongTests()
        self._resizing = CpuResizing(self)
        #: the running commands' output, for ``GET /v1/actions/{id}/output`` (``tangram/server/action_output_api.py``)
        self.outputs = LiveOutputs()

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        for node_config in self.config.nodes:
            backend = await self._open_backend(node_config, self.config)
            await self._into_service(node_config, backend, await backend.adopt(self.config.broker_id))
        self.environments.start_reaping()
        if self.config.join is not None or any(node.agent for node in self.config.nodes):
            from managers.remote.broker.ray_cluster import (
                NODE_RESOURCE_PREFIX,  # Ray is imported only for nodes behind agents
            )
            from managers.remote.broker.ray_membership import RayMembership

            self._membership = RayMembership(self.config.ray, NODE_RESOURCE_PREFIX, self.node_joined, self.node_left)
            await self._membership.start()

    async def _into_service(self, node_config: CpuNodeConfig, backend: SandboxBackend,
                            leftovers: list[Leftover]) -> CpuNode:
        """A new node in service, as its agent reported it from its host (cores, memory, NUMA) or else as
        configured, with the environments a previous run of this broker left there taken over."""
        hardware = backend.hardware
        if hardware is not None:
            node_config = replace(node_config, cores=hardware.cores, memory_mb=hardware.memory_mb,
                                  numa=hardware.numa, pids=node_config.pids or hardware.pids)
        node = CpuNode(node_config, backend, self.sandbox_budget(node_config))
        self.add_node(node)
        for leftover in leftovers:
            await self.environments.take_over(node, leftover)
        if leftovers:
            lost = sum(1 for leftover in leftovers if leftover.sandbox is None)
            log.warning("node %s: took over %d environment(s) a previous run of broker %r left (%d of them "
                        "lost)", node.name, len(leftovers), self.config.broker_id, lost)
        return node

    def sandbox_budget(self, node: CpuNodeConfig) -> int | None:
        """The environments ``node``'s pids budget holds, each reserving ``pids_limit``, after its warm sandboxes
        (None: no budget)."""
        if not node.pids:
            return None
        warm = sum(size for _, size in warm_kinds(self.config))
        budget = (node.pids - warm * self.config.pids_limit) // self.config.pids_limit
        if budget < 1:
            log.warning("node %s: its pids budget (%d) holds no sandbox of pids_limit %d beside %d warm ones",
                        node.name, node.pids, self.config.pids_limit, warm)
        return max(budget, 0)

    def add_node(self, node: CpuNode) -> None:
        """Put a node in service (``start`` does it for every configured node; the simulator, directly)."""
        self.nodes[node.name] = node
        self.environments.metrics.node_in_service(node.name)

    # -- membership (nodes behind agents join and leave with their Ray nodes) ---------------------------------

    async def node_joined(self, name: str) -> None:
        """A Ray node carrying ``name``'s resource is alive: a lost node comes back with the environments it
        still holds; a new one joins if ``[cpu.join]`` lets nodes join."""
        node = self.nodes.get(name)
        if node is not None:
            if node.lost is None:
                return
            node_config = node.config
        elif self.config.join is not None:
            node_config = self.config.join.node(name)
        else:
            return
        try:
            backend = await self._open_backend(node_config, self.config)
            leftovers = await backend.adopt(self.config.broker_id)
        except SandboxError as error:
            log.warning("node %s: not joined (%s)", name, error.message)
            return
        if node is None:
            joined = await self._into_service(node_config, backend, leftovers)
            log.info("node %s joined: %d cores, %d MiB", name, joined.cores.capacity, joined.memory_mb)
            return
        node.come_back(backend)
        revived = await self.environments.come_back(node, leftovers)
        log.info("node %s is back: %d environment(s) with it", name, revived)

    async def node_left(self, name: str, reason: str) -> None:
        """Its Ray node is gone: new environments go elsewhere, its environments are lost (their actions fail
        with the reason), its cores leave the pool, and its agent is let go (its sandboxes stay on the node,
        labelled, for its return)."""
        node = self.nodes.get(name)
        if node is None or node.lost is not None:
            return
        node.lose(reason)
        log.warning("node %s lost: %s", name, reason)
        self.environments.lose_node(node)
        await node.backend.close()

    async def close(self) -> None:
        if self._membership is not None:
            await self._membership.stop()
        await self.environments.close()
        for node in self.nodes.values():
            if node.lost is not None:  # its agent was let go with it
                continue
            if not self.config.keep_sandboxes_on_stop:
                try:  # also the containers no environment knows any more (a removal the engine missed while down)
                    await node.backend.reap(self.config.broker_id)
                except SandboxError as error:
                    log.warning("node %s: leftover sandboxes not reaped at stop (%s)", node.name, error)
            await node.backend.close()

    # -- the scheduler's view -------------------------------------------------------------------------------

    @property
    def resources(self) -> Mapping[str, int]:
        return {RESOURCE: sum(node.cores.capacity for node in self.nodes.values() if node.lost is None)}

    def largest_pool(self, resource: str) -> int:
        return max((node.cores.capacity for node in self.nodes.values() if node.lost is None), default=0)

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
        return self.environments.of_trajectory(*key) if key else None

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
        return self.environments.task_usage(task)

    def holds_environment(self, task: str, trajectory: str) -> bool:
        return self.environments.of_trajectory(task, trajectory) is not None

    def validate(self, action: Action) -> None:
        if action.kind is not Kind.EXEC:
            return
        if RESOURCE not in action.demands:
            raise Unprocessable("demand.cpu", 'exec actions run on cores: add "cpu": 1 (or a range) to demand')
        spec = self.exec_spec(action)
        if spec.background:
            self._check_background(action, spec)
        if spec.run_timeout_s is not None and spec.run_timeout_s > action.timeout_s:
            raise Unprocessable("spec.run_timeout_s", f"must be at most the action's timeout_s ({action.timeout_s} "
                                                      f"s), the deadline from submission that bounds the run too")
        if spec.environment is not None:
            env = self.environments.get(spec.environment)
            if env is None or env.task != action.task:
                raise NotFound("spec.environment", f"task {action.task!r} has no environment {spec.environment!r}")
            if env.state is EnvState.LOST:
                raise Conflict("spec.environment", f"environment {env.id} is lost ({env.lost_reason}); delete it "
                                                   f"and create another")
            self._check_user(spec, env.sandbox_user)
            return
        self.environments.check_memory(spec.memory_mb, "spec.memory_mb")
        self.config.egress.admit(spec.network, "spec.network")
        existing = self.environment_of(action)
        if existing is not None and spec.network is not None and spec.network != existing.network:
            raise Unprocessable("spec.network", f"trajectory {action.trajectory!r} has its environment {existing.id} "
                                                f"already, with another network: a network is chosen when an "
                                                f"environment is created")
        self._check_user(spec, existing.sandbox_user if existing is not None else spec.sandbox_user)
        if existing is None:
            self.environments.check_room("spec")
        elif spec.sandbox_user is not None and spec.sandbox_user != existing.sandbox_user:
            raise Unprocessable("spec.sandbox_user", f"trajectory {action.trajectory!r} has its environment "
                                                     f"{existing.id} already, running as {existing.sandbox_user}: a "
                                                     f"user is chosen when an environment is created")

    def _check_user(self, spec: ExecSpec, sandbox_user: str | None) -> None:
        """A Docker sandbox drops every capability, root's too, so its executor cannot change users: ``spec.user``
        may give the ids of the environment's own user only. A name is looked up in the image by the executor,
        which refuses one of another user (exec_error); local processes are the executor's to judge."""
        own = sandbox_user or self.config.sandbox_user
        if spec.user is None or isinstance(spec.user, str) and ":" not in spec.user \
                or any(node.config.backend == "local" for node in self.nodes.values()):
            return
        uid, gid = sandbox_owner(own)
        if spec.user in (uid, f"{uid}:{gid}"):
            return
        raise Unprocessable("spec.user", f"the environment runs as {own} and its sandbox holds no capability to "
                                         f"change users (all are dropped, root's too): give its own ids ({uid}:"
                                         f"{gid}) or leave user out")

    def _check_background(self, action: Action, spec: ExecSpec) -> None:
        """A background command lives in an environment that outlives its action, in a container that can end it
        with the environment (the executor refuses one elsewhere; this says so at submit where no node could)."""
        if action.trajectory is None and spec.environment is None:
            raise Unprocessable("spec.background", "needs a trajectory or an environment: the environment of a "
                                                   "one-off action goes when the action ends")
        if all(node.config.backend == "local" for node in self.nodes.values()):
            raise Unprocessable("spec.background", "needs Docker sandboxes: on local processes a background "
                                                   "command would outlive its environment")

    def allocate(self, action: Action, units: Mapping[str, int], pools: Mapping[str, str]) -> Allocation[CpuHandle]:
        node = self.nodes[pools[RESOURCE]]
        env = self.environment_of(action)
        spec = self.exec_spec(action)
        if env is None and spec.environment is not None:  # deleted since submit: fails at run
            cores = node.cores.take(units[RESOURCE])
            return Allocation(action.id, dict(units), dict(pools), handle=(None, node.name, cores))
        if env is None:
            env = self.environments.reserve(action.task, action.trajectory, node,
                                            spec.image or self.config.default_image, self.memory_for(action),
                                            dict(spec.files), ephemeral=action.trajectory is None,
                                            reserved_by=action.id, sandbox_user=spec.sandbox_user,
                                            network=spec.network)
        elif env.node != node.name:
            raise RuntimeError(f"environment {env.id} lives on {env.node}, not {node.name}")
        cores = node.cores.take(units[RESOURCE])
        placement = {"node": node.name, "cores": list(cores), "numa_nodes": node.cores.numa_of(cores),
                     "environment": env.id}
        return Allocation(action.id, dict(units), dict(pools), placement={RESOURCE: placement},
                          handle=(env, node.name, cores))

    def resizing(self, resource: str) -> CpuResizing | None:
        return self._resizing if resource == RESOURCE and self.config.malleable else None

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
                                          "free_cores": sorted(node.cores.free), "lost": node.lost}))
            rows.append(PoolStatus("memory_mb", node.name, node.memory_mb, node.memory_reserved,
                                   extra={"environments": len(envs), "sandbox_room": node.sandbox_room}))
        return rows

    # -- execution ------------------------------------------------------------------------------------------

    async def execute(self, action: Action, allocation: Allocation[CpuHandle]) -> Outcome:
        env = allocation.held()[0]
        if env is None:
            raise ActionFailed("environment_destroyed", f"environment {self.exec_spec(action).environment} was "
                                                        f"deleted after this action was submitted")
        try:
            return await self._execute_in(env, action, allocation)
        except ActionFailed as failure:
            if failure.code == NODE_UNAVAILABLE and (lost := await self.nodes[env.node].lost_within()) is not None:
                raise ActionFailed("node_lost", lost, environment=env.id) from None
            raise

    async def _execute_in(self, env: Environment, action: Action, allocation: Allocation[CpuHandle]) -> Outcome:
        spec = self.exec_spec(action)
        setup_started = time.perf_counter()
        try:
            sandbox = await self.environments.sandbox(env)
            setup_s = time.perf_counter() - setup_started
            remaining = action.submitted_at + action.timeout_s - time.time() - DEADLINE_MARGIN_S
            # the command's own limit counts from its start here, whatever it waited; the deadline still bounds it
            limit, timeout_s = ("run_timeout_s", spec.run_timeout_s) \
                if spec.run_timeout_s is not None and spec.run_timeout_s < remaining else ("timeout_s", remaining)
            cores = allocation.held()[2]  # as resized while the sandbox was being created
            held = action.malleable
            # an executor adopted from an older broker has no runner beside it: xdist on the cores it starts on
            runner = "xdist" if getattr(sandbox, "old_executor", False) else self.config.pytest_runner
            request = exec_request(spec, cores, max(timeout_s, 0.001), sandbox.workdir,
                                   {"TANGRAM_ACTION_ID": action.id, "TANGRAM_ENVIRONMENT": env.id},
                                   workers=held.workers if held is not None else None,
                                   follows=held is not None and held.follows, runner=runner,
                                   long_tests=self.long_tests.hint((action.task, action.signature)))
            env.running.add(action.id)
            try:
                if spec.files and env.reserved_by != action.id:  # not written when the environment was made
                    async with env.turns.alone():
                        await alone(self.environments, env, WriteFiles(spec.files))
                async with env.turns.command():
                    current().check()  # a deposed leader runs no more commands (tangram/core/fencing.py)
                    live = self.outputs.open(action.id, request.output_limit)
                    try:
                        executed = await sandbox.execute(action.id, request, live)
                    finally:
                        self.outputs.close(action.id)
            except SandboxError as error:
                if error.lost:
                    self.environments.mark_lost(env, LossCause.SANDBOX_DIED, error.message)
                raise ActionFailed(error.code, error.message, environment=env.id) from None
            finally:
                env.running.discard(action.id)
                env.last_used = time.time()
            if executed.unsettled is not None and env.state is EnvState.READY:
                self.environments.mark_lost(env, LossCause.CORES_UNSETTLED, executed.unsettled)
        finally:
            if env.ephemeral and not env.running:
                await self.environments.destroy(env)
        result = action_result(executed.result, env, allocation.held()[2], setup_s, limit, spec.run_timeout_s
                               if limit == "run_timeout_s" else action.timeout_s)
        if request.pytest_runner:
            result["pytest_runner"] = runner_report(executed.result.stdout)
            self.pytest_runs.labels(result["pytest_runner"]["runner"]).inc()
            self.long_tests.learn((action.task, action.signature), long_tests_from(executed.result.stdout))
        return Outcome(result)

    def plugins(self) -> CyclePlugins:
        return CyclePlugins(metrics=self._register_metrics, environments=self)

    def _register_metrics(self, registry: MetricsRegistry) -> None:
        registry.register(self.pytest_runs)
        self.environments.metrics.register(registry)
