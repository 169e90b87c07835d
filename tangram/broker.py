"""The broker: accepts actions, runs scheduling passes on every submit and completion, executes, records.

The pass is the cycle's (``tangram/sched/cycle.py``), the broker applies it: the running of what it starts is
``tangram/execution.py``'s, the checks at submit ``tangram/submit_checks.py``'s, the records kept in memory
``tangram/action_memory.py``'s.

Scheduling is event-driven and coalescing: submits and completions only set a flag; one loop task runs a pass
whenever the flag is set, so a burst of a thousand submits costs a handful of passes, not a thousand.
A ticker handles what time alone changes: quota windows refilling, lease TTLs, deadlines of queued actions and
forgetting old records from memory (they stay in the store).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from tangram.action_memory import ActionMemory
from tangram.core.action import Action, Kind, State
from tangram.core.errors import Conflict, NotFound, Unavailable
from tangram.core.seam import Allocation, CyclePlugins, Lessor, ResourceManager
from tangram.execution import Executions
from tangram.idempotency import IdempotencyIndex
from tangram.leases import Leases
from tangram.log_context import bound_action
from tangram.metrics import Metrics
from tangram.recovery import triage
from tangram.sched.cycle import Cycle
from tangram.sched.profile import SchedulerProfile
from tangram.sched.scheduler import Placement, Plan
from tangram.sched.tenants import Tenancy
from tangram.store.store import Store
from tangram.submit_checks import SubmitChecks
from tangram.tracing import ActionTracer

log = logging.getLogger("tangram.broker")


class Broker:
    def __init__(self, managers: Sequence[ResourceManager], store: Store, profile: SchedulerProfile, *,
                 plugins: Sequence[CyclePlugins] = (), max_queue: int = 100_000, retain_s: float = 600.0,
                 tick_s: float = 0.25, tracer: ActionTracer | None = None) -> None:
        """``profile``: the cycle's plugins and their arguments (``[scheduler]``), as the simulator takes them;
        ``plugins``: the cycle's beyond the managers' (SLO admission's); ``max_queue``: submits beyond get 503;
        ``retain_s``: how long finished records stay in memory; ``tracer``: makes ended actions' spans (None: no
        tracing)."""
        self.managers = list(managers)
        self.store = store
        self.cycle = Cycle(self.managers, profile, plugins=plugins)
        self.owner = self.cycle.owner
        self.executor = self.cycle.executor
        lessor = self.executor.get(Kind.LEASE)
        #: grants leases at once, without a task
        self.lessor = lessor if isinstance(lessor, Lessor) else None
        self.queue = self.cycle.queue
        self.durations = self.cycle.durations
        self.ledger = self.cycle.ledger
        self.metrics = Metrics()
        self.tracer = tracer
        self.metrics.watch(lambda: dict(self.queue.depth_by_resource()),
                           lambda: ((row.resource, row.pool, row.capacity, row.in_use)
                                    for manager in self.managers for row in manager.status()))
        self.cycle.register_metrics(self.metrics.registry)
        self.max_queue = max_queue
        self.tick_s = tick_s
        self.idempotency = IdempotencyIndex()
        self.memory = ActionMemory(retain_s, self.idempotency)
        self.actions = self.memory.by_id
        self.recent = self.memory.recent
        self.executions = Executions(self.cycle, self._finish, self.kick, self.metrics.resizes.inc)
        self.running = self.executions.running
        self.checks = SubmitChecks(self.cycle, self.executions)
        self.leases = Leases(store, self.ledger)
        self._waiters: dict[str, asyncio.Event] = {}
        self.passes = 0  # scheduling passes run (coalescing makes this far smaller than submits + completions)
        self._seq = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.draining = False

    # -- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        for task, signature, t1, samples in await self.store.load_profiles():
            self.durations.load(task, signature, t1, samples)
        for task, signature, runs in await self.store.load_speedups():
            self.durations.load_runs(task, signature, runs)
        self._seq = await self.store.max_seq()
        for manager in self.managers:
            await manager.start()
        await self._recover()
        self._tasks = [asyncio.create_task(self._schedule_loop(), name="tangram-schedule"),
                       asyncio.create_task(self._tick_loop(), name="tangram-tick")]

    async def _recover(self) -> None:
        """Take over what a previous run of this broker left unfinished in the store (after a crash or ``kill -9``,
        or the queue a clean stop left): ``tangram.recovery`` says what becomes of each action."""
        triaged = triage(await self.store.load_unfinished(), lambda action: self.checks.validate(action, ""))
        for action, error in triaged.ended:
            self.memory.remember(action)
            self._finish(action, State.FAILED, error=error)
        for action in triaged.resumed:
            self.memory.remember(action)
            self.cycle.enqueue(action)
        regranted = await self.leases.regrant(self.executor.get(Kind.LEASE))
        for action in regranted:
            self.memory.remember(action)
        self.kick()
        if triaged.resumed or triaged.ended or regranted:
            log.warning("recovered from the store: %d queued actions resumed, %d unfinished ones ended failed, "
                        "%d leases held again", len(triaged.resumed), len(triaged.ended), len(regranted))

    async def drain(self, timeout_s: float) -> int:
        """Stop taking and starting actions and give the running ones up to ``timeout_s`` to finish; the queued ones
        stay in the store for the next start. Returns how many were still running at the bound (``close``
        cancels them)."""
        self.draining = True
        await self.executions.wait(timeout_s)
        for event in self._waiters.values():  # long polls on queued actions answer now (202), not at their timeout
            event.set()
        if self.running or len(self.queue):
            log.warning("drained: %d actions still running at the %.0f s bound, %d queued ones kept for the next "
                        "start", len(self.running), timeout_s, len(self.queue))
        return len(self.running)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.executions.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._save_learned()
        for manager in self.managers:
            await manager.close()

    # -- client operations --------------------------------------------------------------------------------

    async def submit(self, actions: Sequence[Action]) -> list[tuple[Action, bool]]:
        """Queue actions (all or none are validated first). Returns each record and whether it is new."""
        if self.draining:
            raise Unavailable("actions", "the broker is shutting down; submit again in a moment (to its successor)")
        if len(self.queue) + len(actions) > self.max_queue:
            raise Unavailable("actions", f"the queue is full ({self.max_queue} actions); retry later")
        try:
            stored = await self.idempotency.stored(actions, self.store)
        except Exception as error:  # noqa: BLE001 - any driver error: the database cannot answer now
            log.error("idempotency lookup failed: %r", error)
            raise Unavailable("store", "the database is unavailable, so this broker cannot tell whether these "
                                       "idempotency keys were used before; retry with the same keys") from None
        replayed = self.idempotency.check_replays(actions, stored, self.actions)
        for index, (action, earlier) in enumerate(zip(actions, replayed, strict=True)):
            # a replay was checked when it came first; checked again now, it could be refused for what it did
            # since (its trajectory's environment, which it made, now exists)
            if earlier is None:
                self.checks.validate(action, f"actions[{index}]." if len(actions) > 1 else "")
        if self.ledger.limited:  # after the last await: nothing is queued between the check and the pushes
            self.checks.check_caps(actions, replayed)
        results: list[tuple[Action, bool]] = []
        fresh: list[Action] = []
        for action in actions:
            existing = self.idempotency.existing(action, stored, self.actions)
            if existing is not None:
                results.append((existing, False))
                continue
            self._seq += 1
            action.seq = self._seq
            action.submitted_at = time.time()
            self.memory.remember(action)
            self.cycle.submit(action, action.submitted_at)
            self.metrics.count_submit(action)
            results.append((action, True))
            fresh.append(action)
        if fresh:
            self.kick()
            try:
                await self.store.durable(*fresh)
            except Exception as error:  # noqa: BLE001 - queued and still pending in the store, which keeps retrying
                log.error("submit not durable yet: %r", error)
                raise Unavailable("store", "accepted but not yet durable (database unavailable); resubmit with "
                                           "the same idempotency_key to learn its fate") from None
        return results

    def set_tenancy(self, tenancy: Tenancy) -> None:
        """New per-task caps, from now on (a lowered cap takes nothing away; it stops what would pass it)."""
        self.ledger.tenancy = tenancy
        self.kick()

    async def get(self, action_id: str, task: str | None = None) -> Action:
        """The action's record; with ``task``, another task's action is as missing as one that never was."""
        action = self.actions.get(action_id)
        if action is None:
            action = await self.store.get(action_id)
        if action is None or (task is not None and action.task != task):
            raise NotFound("id", f"no action {action_id!r}")
        return action

    async def wait(self, action_id: str, timeout_s: float) -> Action:
        """The record once terminal, or as it stands after ``timeout_s`` (at once while draining, for an action that
        will not run in this process)."""
        action = await self.get(action_id)
        if action.state.terminal or (self.draining and action_id not in self.running):
            return action
        event = self._waiters.setdefault(action_id, asyncio.Event())
        try:
            async with asyncio.timeout(timeout_s):  # no task per waiting request, as wait_for would make
                await event.wait()
        except TimeoutError:
            pass
        return action

    async def cancel(self, action_id: str) -> Action:
        action = await self.get(action_id)
        if action.state.terminal:
            raise Conflict("id", f"action is already {action.state.value}")
        if self.cycle.dequeue(action_id) is not None:
            self._finish(action, State.CANCELLED, error={"code": "cancelled", "message": "cancelled by client"})
        elif not await self.executions.cancel(action_id):  # only a record in the store: nothing of it runs here
            raise Conflict("id", f"action is {action.state.value} but not running in this broker")
        return action

    async def release_lease(self, action_id: str) -> Action:
        action = await self.get(action_id)
        self.leases.check_releasable(action)
        self._return_lease(action, "released")
        return action

    # -- scheduling -------------------------------------------------------------------------------------

    def kick(self) -> None:
        self._wake.set()

    async def _schedule_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self.schedule_once()
            except Exception:  # a scheduling bug must not stop the broker; the next event retries
                log.exception("scheduling pass failed")
                self.cycle.scheduler.reshare()
            await asyncio.sleep(0)  # let completions and submits of this moment coalesce into the next pass

    def schedule_once(self) -> int:
        """One pass (``tangram/sched/cycle.py``), applied: resize running malleable actions and start what the scheduler
        places (shrinks first, so the units they give up are free for the starts; grows last, into what is left)."""
        if self.draining or not (len(self.queue) or self.executions.malleable_running):
            return 0
        self.passes += 1
        now = time.time()
        plan = self.cycle.pass_once(now, [r.action for r in self.running.values()],
                                    lambda plan: self._apply(plan, now))
        return len(plan.placements)

    def _apply(self, plan: Plan, now: float) -> None:
        self.metrics.schedule_pass.observe(self.cycle.last_pass_s)
        for decision in plan.shrinks():
            self.executions.shrink(decision, now)
        after = self.executions.shrinks_in_flight()
        for placement in plan.placements:
            self._start(placement, now, after)
        for decision in plan.grows():
            self.executions.resize(decision, now)

    def _start(self, placement: Placement, now: float, after: frozenset[asyncio.Task[None]]) -> None:
        action = placement.action
        try:
            allocations = self.cycle.start(placement, now)
        except Exception as error:  # noqa: BLE001 - a manager refused what its fit accepted: back off, then fail
            self.cycle.scheduler.reshare()
            backoff = self.cycle.backoff
            delay = backoff.failed(action.id, time.time())
            if delay is not None:
                log.warning("allocation of %s failed (%d of %d tries; next in %.1f s): %r", action.id,
                            backoff.count(action.id), backoff.attempts, delay, error)
                asyncio.get_running_loop().call_later(delay, self.kick)
                return
            log.error("allocation of %s failed %d times, failing it: %r", action.id, backoff.attempts, error)
            self.cycle.dequeue(action.id)
            self._finish(action, State.FAILED, error={
                "code": "allocation_failed",
                "message": f"allocating {placement.units} failed {backoff.attempts} times; last: {error!r}"})
            self.kick()  # actions it held back (FCFS) may go now
            return
        action.state = State.RUNNING
        executor = self.executor[action.kind]
        own = next((a for m, a in allocations if m is executor), None) or Allocation(action.id, {}, {})
        if action.kind is Kind.LEASE and self.lessor is not None:  # granted at once, held until returned
            action.execution_s = 0.0
            self.ledger.hold(action)
            self._finish(action, State.SUCCEEDED, result=self.lessor.grant(action, own).result, keep=allocations)
            return
        self.ledger.hold(action)
        self.store.save(action)
        self.executions.run(action, allocations, own, after)

    def _finish(self, action: Action, state: State, *, result: Any = None, error: dict[str, Any] | None = None,
                keep: list[tuple[ResourceManager, Allocation]] | None = None) -> None:
        action.state = state
        action.finished_at = time.time()
        action.result = result
        action.error = error
        if keep is not None:
            self.leases.hold(action, keep)
        self.cycle.ended(action, action.finished_at, state is State.SUCCEEDED)
        self.store.save(action)
        self.metrics.record_finish(action)
        self.memory.ended(action, action.finished_at)
        if self.tracer is not None:
            self.tracer.ended(action)
        if log.isEnabledFor(logging.DEBUG):  # off the hot path unless asked for
            with bound_action(action):  # one line per action, carrying its fields in JSON logs
                log.debug("action %s ended %s", action.id, state.value)
        event = self._waiters.pop(action.id, None)
        if event is not None:
            event.set()

    def _return_lease(self, action: Action, how: str) -> None:
        self.leases.give_back(action, how)
        returned = time.time()
        self.memory.returned(action.id, returned)
        if self.tracer is not None:
            self.tracer.lease_returned(action, returned, how)
        self.kick()

    # -- time-driven work -----------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            delay = self.tick_s
            hint = self.cycle.next_change_in()
            if hint is not None:
                delay = min(delay, max(hint, 0.001))
            await asyncio.sleep(delay)
            try:
                self.tick()
            except Exception:
                log.exception("tick failed")

    def tick(self) -> None:
        now = time.time()
        for action_id in self.leases.expired(self.managers):
            action = self.actions.get(action_id)
            if action is not None:
                self._return_lease(action, "expired")
        for action in list(self.queue):
            if action.submitted_at + action.timeout_s <= now:
                self.cycle.dequeue(action.id)
                self._finish(action, State.TIMED_OUT, error={
                    "code": "timed_out", "limit": "timeout_s", "message": f"still queued when its deadline of {action.timeout_s} s passed"})
        self.memory.forget_old(now, self.leases)
        if self.durations.dirty:  # a run of a speed-up model is always a profile's sample too
            self._save_learned()
        self.kick()

    def _save_learned(self) -> None:
        self.store.save_profiles(self.durations.take_dirty())
        self.store.save_speedups(self.durations.take_dirty_runs())
