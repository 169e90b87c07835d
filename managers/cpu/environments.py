"""The lifecycle of trajectory environments, apart from the cores they run on (paper §5.2).

An environment is reserved on a node (its memory counts at once), its sandbox is created by its first action (or by
``POST /v1/environments``), it is frozen between actions, reaped when idle past the TTL, taken over under its old id
after a restart, and marked lost when its sandbox dies. The CPU manager decides which node and which cores; this
component keeps the environments themselves and answers the per-task caps (``tangram.sched.tenants``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping

from managers.cpu.config import CpuConfig
from managers.cpu.environment import Environment, EnvState, LossCause
from managers.cpu.node import CpuNode
from managers.cpu.sandbox_metrics import SandboxMetrics
from sandboxes.backend import Leftover, Sandbox, SandboxError
from tangram.core.action import new_action_id
from tangram.core.errors import ActionFailed, Conflict, NotFound, TooMany, Unavailable, Unprocessable
from tangram.core.fencing import current

log = logging.getLogger("tangram.cpu")

#: when to try again while no node is in service
NO_NODE_RETRY_S = 5.0
#: sandbox errors at creation that are the request's fault (a 422 on ``POST /v1/environments``), not the engine's
IMAGE_ERRORS = frozenset({"image_not_found", "image_without_python3", "image_pull_denied"})


class Environments(Mapping[str, Environment]):
    """Environments by id, and by (task, trajectory) for a trajectory's later actions."""

    def __init__(self, config: CpuConfig, nodes: Mapping[str, CpuNode]) -> None:
        """``nodes`` is the CPU manager's own map (nodes added later are seen)."""
        self.config = config
        self.nodes = nodes
        self._by_id: dict[str, Environment] = {}
        self._by_trajectory: dict[tuple[str, str], Environment] = {}
        #: per task: its environments and the MiB they reserve (for per-task caps, tangram.sched.tenants)
        self._task_count: Counter[str] = Counter()
        self._task_memory_mb: Counter[str] = Counter()
        self._reaper: asyncio.Task[None] | None = None
        self.metrics = SandboxMetrics(self.alive_by_node)

    def __getitem__(self, env_id: str) -> Environment:
        return self._by_id[env_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def of_trajectory(self, task: str, trajectory: str) -> Environment | None:
        return self._by_trajectory.get((task, trajectory))

    def alive_by_node(self) -> dict[str, int]:
        """The ready sandboxes on each node in service (0 for one without any)."""
        alive = {name: 0 for name, node in self.nodes.items() if node.lost is None}
        for env in self._by_id.values():
            if env.state is EnvState.READY:
                alive[env.node] = alive.get(env.node, 0) + 1
        return alive

    def task_usage(self, task: str) -> tuple[int, int]:
        """The task's environments and the MiB they reserve."""
        return self._task_count[task], self._task_memory_mb[task]

    # -- reserving and forgetting -----------------------------------------------------------------------------

    def reserve(self, task: str, trajectory: str | None, node: CpuNode, image: str, memory_mb: int,
                files: dict[str, bytes], *, ephemeral: bool, reserved_by: str | None = None,
                sandbox_user: str | None = None, network: tuple[str, ...] | None = None) -> Environment:
        """A new environment on ``node``, its memory reserved now and its sandbox created by ``sandbox``;
        ``reserved_by``: the action it is made for; ``sandbox_user``: who runs in it (None: ``[cpu]
        sandbox_user``); ``network``: its egress allow-list (None: no network)."""
        env = Environment(id="env-" + new_action_id(), task=task, trajectory=trajectory, node=node.name,
                          image=image, memory_mb=memory_mb, files=files, ephemeral=ephemeral, reserved_by=reserved_by,
                          sandbox_user=sandbox_user or self.config.sandbox_user, network=network)
        self._register(env)
        return env

    def _register(self, env: Environment) -> None:
        self.nodes[env.node].memory_reserved += env.memory_mb
        self.nodes[env.node].environments += 1
        self._by_id[env.id] = env
        self._task_count[env.task] += 1
        self._task_memory_mb[env.task] += env.memory_mb
        if env.trajectory is not None:
            self._by_trajectory[(env.task, env.trajectory)] = env

    def detach(self, env: Environment) -> Sandbox | None:
        """Forget ``env`` and free its memory reservation at once; returns its sandbox for the caller to destroy
        (None if it had none or was already detached)."""
        if env.state is EnvState.DESTROYED:
            return None
        env.state = EnvState.DESTROYED
        self._by_id.pop(env.id, None)
        if env.trajectory is not None and self._by_trajectory.get((env.task, env.trajectory)) is env:
            del self._by_trajectory[(env.task, env.trajectory)]
        self.nodes[env.node].memory_reserved -= env.memory_mb
        self.nodes[env.node].environments -= 1
        self._task_count[env.task] -= 1
        self._task_memory_mb[env.task] -= env.memory_mb
        if not self._task_count[env.task]:
            del self._task_count[env.task], self._task_memory_mb[env.task]
        return env.sandbox

    async def destroy(self, env: Environment) -> None:
        """Forget the environment (its memory and cores return at once) and remove its sandbox. A sandbox the
        engine cannot remove now (the engine is down) is logged; the next start's reaping removes it."""
        sandbox = self.detach(env)
        if sandbox is not None and current().deposed_by is not None:
            # the new leader took this sandbox over (or will reap it): a deposed broker removes nothing
            log.warning("environment %s: sandbox left to the broker that leads now", env.id)
        elif sandbox is not None:
            try:
                await sandbox.destroy()
            except SandboxError as error:
                log.warning("environment %s: sandbox not removed (%s); the next start reaps it", env.id, error)

    def mark_lost(self, env: Environment, cause: LossCause, reason: str) -> None:
        log.warning("environment %s lost: %s", env.id, reason)
        if env.state is not EnvState.LOST:
            self.metrics.lost.labels(env.node, cause.value).inc()
        env.state = EnvState.LOST
        env.lost_reason = reason

    async def take_over(self, node: CpuNode, leftover: Leftover) -> None:
        """A previous run's environment becomes this run's under its old id: its trajectory's next action finds
        its files and processes, or, if it was lost, an ``environment_lost`` error saying why. Its memory counts
        even past today's node size: the sandbox uses it whatever the config says now."""
        key = (leftover.task, leftover.trajectory) if leftover.trajectory is not None else None
        if leftover.env_id in self._by_id or (key is not None and key in self._by_trajectory):
            if leftover.sandbox is not None:  # two sandboxes claim one trajectory: keep the first
                await leftover.sandbox.destroy()
            return
        env = Environment(id=leftover.env_id, task=leftover.task, trajectory=leftover.trajectory, node=node.name,
                          image=leftover.image, memory_mb=leftover.memory_mb, created_at=leftover.created_at,
                          sandbox=leftover.sandbox, network=leftover.network)
        if leftover.sandbox is not None:
            env.state = EnvState.READY
            self.metrics.adopted.labels(node.name).inc()
        else:
            self.mark_lost(env, LossCause.GONE_AT_RESTART,
                           leftover.lost_reason or "the broker restarted and the sandbox was gone")
        self._register(env)

    def lose_node(self, node: CpuNode) -> None:
        """Its node left: each of its environments is lost, with the node's reason."""
        for env in self._by_id.values():
            if env.node == node.name and env.state in (EnvState.PENDING, EnvState.READY):
                self.mark_lost(env, LossCause.NODE_LEFT, node.lost or "its node left")

    async def come_back(self, node: CpuNode, leftovers: list[Leftover]) -> int:
        """Its node is back: each environment lost with it whose sandbox is still there is ready again, with its
        files and processes; the other sandboxes (environments deleted while the node was away) are removed.
        Returns how many came back."""
        revived = 0
        for leftover in leftovers:
            env = self._by_id.get(leftover.env_id)
            if leftover.sandbox is None:
                continue
            if env is None or env.node != node.name or env.state is not EnvState.LOST:
                await leftover.sandbox.destroy()
                continue
            env.sandbox, env.state, env.lost_reason = leftover.sandbox, EnvState.READY, None
            revived += 1
        return revived

    # -- sandboxes --------------------------------------------------------------------------------------------

    async def sandbox(self, env: Environment) -> Sandbox:
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

    def create_from(self, env: Environment, image: Awaitable[str]) -> None:
        """Start creating ``env``'s sandbox from the image ``image`` gives (a fork's snapshot of its source); its
        actions and ``sandbox`` wait for it meanwhile, never creating it from its base image."""
        async def create() -> Sandbox:
            try:
                env.snapshot = await image
            except BaseException:
                env.creating = None
                await self.destroy(env)
                raise
            return await self._create(env)

        env.creating = asyncio.create_task(create(), name=f"tangram-create-{env.id}")
        env.creating.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _create(self, env: Environment) -> Sandbox:
        node = self.nodes[env.node]
        spec = self.config.sandbox_spec(env.id, env.task, env.trajectory, env.snapshot or env.image, env.memory_mb,
                                        files=env.files,
                                        ephemeral=env.ephemeral, created_at=env.created_at,
                                        user=env.sandbox_user or self.config.sandbox_user, egress=env.network)
        started = time.monotonic()
        try:
            current().check()  # a deposed leader makes no more sandboxes (tangram/core/fencing.py)
            sandbox = await node.backend.create(spec)
        except BaseException:
            await self.destroy(env)  # frees the memory; the next action of the trajectory may try again
            raise
        finally:
            env.creating = None
        self.metrics.made(node.name, sandbox.claimed_warm, time.monotonic() - started)
        env.files = {}
        if env.state is EnvState.DESTROYED:  # deleted while being created
            await sandbox.destroy()
            raise SandboxError("environment_destroyed", f"environment {env.id} was deleted while being created")
        env.sandbox = sandbox
        env.state = EnvState.READY
        return sandbox

    # -- the environments API ---------------------------------------------------------------------------------

    def largest_memory_mb(self) -> int | None:
        """The memory of the largest node in service (None while none is): the most one environment may reserve."""
        return max((node.memory_mb for node in self.nodes.values() if node.lost is None), default=None)

    def check_memory(self, memory_mb: int | None, field: str) -> int:
        """The memory a new environment reserves; 422 when no node could ever hold it."""
        memory = memory_mb or self.config.default_memory_mb
        largest = self.largest_memory_mb()
        if largest is None:
            raise Unavailable(field, "no CPU node is in service now (nodes join from the Ray cluster)",
                              retry_after_s=NO_NODE_RETRY_S)
        if memory > largest:
            raise Unprocessable(field, f"{memory} MiB is more than any node offers ({largest} MiB)")
        return memory

    def check_room(self, field: str) -> None:
        if len(self._by_id) >= self.config.max_environments:
            raise TooMany(field, f"the broker holds {len(self._by_id)} environments, its limit; delete idle ones or "
                                 f"wait for their TTL")

    async def create(self, task: str, trajectory: str | None, image: str | None, memory_mb: int | None,
                     files: dict[str, bytes], admit: Callable[[int], None] | None = None,
                     sandbox_user: str | None = None, network: tuple[str, ...] | None = None) -> Environment:
        """``POST /v1/environments``: place by memory load, create the sandbox now, report errors as 4xx.
        ``admit(memory_mb)`` may refuse (raise) once the request is known to be valid, before anything is reserved
        (the per-task caps)."""
        existing = self.of_trajectory(task, trajectory) if trajectory is not None else None
        if existing is not None:
            raise Conflict("trajectory", f"trajectory {trajectory!r} of task {task!r} already has environment "
                                         f"{existing.id}")
        self.check_room("environments")
        memory = self.check_memory(memory_mb, "memory_mb")
        if admit is not None:
            admit(memory)
        fitting = [n for n in self.nodes.values() if n.lost is None and n.memory_reserved + memory <= n.memory_mb
                   and n.has_room_for()]
        if not fitting:
            raise TooMany("memory_mb", f"no node has {memory} MiB unreserved and room for another sandbox in its "
                                       f"pids budget now; delete idle environments or retry later")
        image = image or self.config.default_image
        locality = self.config.images.locality
        node = min(fitting, key=lambda n: (n.memory_load_after(memory) + locality * n.lacks_image(image),
                                           -len(n.cores.free)))
        env = self.reserve(task, trajectory, node, image, memory, files,
                           ephemeral=False, sandbox_user=sandbox_user, network=network)
        try:
            await self.sandbox(env)
        except ActionFailed as failure:
            refused = Unprocessable if failure.code in IMAGE_ERRORS else Unavailable
            raise refused("image", failure.message, code=failure.code) from None
        return env

    def named(self, env_id: str) -> Environment:
        """The environment ``env_id``; 404 if there is none."""
        env = self._by_id.get(env_id)
        if env is None:
            raise NotFound("id", f"no environment {env_id!r}")
        return env

    async def delete(self, env_id: str) -> Environment:
        env = self.named(env_id)
        if env.running or env.turns.busy:
            raise Conflict("id", f"environment {env_id} runs {len(env.running)} action(s) or a file op; cancel them "
                                 f"first, or wait for them")
        await self.destroy(env)
        return env

    # -- reaping and stopping ---------------------------------------------------------------------------------

    def start_reaping(self) -> None:
        self._reaper = asyncio.create_task(self._reap_idle(), name="tangram-cpu-reaper")

    async def _reap_idle(self) -> None:
        """Destroy environments idle past the TTL (and pending ones whose action never came)."""
        period = min(5.0, self.config.idle_ttl_s / 2)
        while True:
            await asyncio.sleep(period)
            now = time.time()
            for env in list(self._by_id.values()):
                if not env.running and not env.turns.busy and env.creating is None \
                        and now - env.last_used > self.config.idle_ttl_s:
                    log.info("environment %s idle for %.0f s: destroyed", env.id, now - env.last_used)
                    try:
                        await self.destroy(env)
                    except Exception:  # keep reaping the others
                        log.exception("destroying %s failed", env.id)

    async def close(self) -> None:
        """Stop reaping and destroy every environment, except the ready ones ``keep_sandboxes_on_stop`` keeps for
        the next start to take over."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        keep = self.config.keep_sandboxes_on_stop
        kept = [env for env in self._by_id.values() if keep and env.state is EnvState.READY and not env.ephemeral]
        await asyncio.gather(*(self.destroy(env) for env in list(self._by_id.values()) if env not in kept),
                             return_exceptions=True)
        if kept:
            log.warning("%d sandboxes kept for the next start of broker %r to adopt (cpu.keep_sandboxes_on_stop)",
                        len(kept), self.config.broker_id)
