"""The broker: accepts actions, runs scheduling passes on every submit and completion, executes, records.

Scheduling is event-driven and coalescing: submits and completions only set a flag; one loop task runs a pass
whenever the flag is set, so a burst of a thousand submits costs a handful of passes, not a thousand.
A ticker handles what time alone changes: quota windows refilling, lease TTLs, deadlines of queued actions and
forgetting old records from memory (they stay in the store).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tangram.core.action import Action, Kind, State
from tangram.core.errors import ActionFailed, BadRequest, Conflict, NotFound, RequestError, Unavailable, Unprocessable
from tangram.core.seam import Allocation, ResourceManager
from tangram.idempotency import IdempotencyIndex
from tangram.leases import Leases
from tangram.metrics import Metrics
from tangram.recovery import triage
from tangram.sched import dispatch
from tangram.sched.arrivals import ArrivalModel
from tangram.sched.cycle import Cycle
from tangram.sched.durations import DurationModel
from tangram.sched.queue import make_queue
from tangram.sched.scheduler import Placement, Plan, Resize, Scheduler
from tangram.store import Store
from tangram.tenants import MAX_RETRY_S, EnvironmentHost, Tenancy

log = logging.getLogger("tangram.broker")


class _Running:
    """An action being executed: every manager's allocation, and the executor's own (empty if it owns none)."""

    __slots__ = ("action", "after", "allocation", "allocations", "cancel_reason", "failure", "task")

    def __init__(self, action: Action, allocations: list[tuple[ResourceManager, Allocation]],
                 allocation: Allocation, after: frozenset[asyncio.Task[None]]) -> None:
        self.action = action
        self.allocations = allocations
        self.allocation = allocation
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason: State | None = None
        self.failure: dict[str, Any] | None = None  # why it was ended from outside (a resize that failed)
        #: the shrinks in flight when it started: units it took may still be in use until they are applied
        self.after = after


class Broker:
    def __init__(self, managers: Sequence[ResourceManager], store: Store, *, policy: str = "fcfs",
                 depth: int = 2, horizon: int = 64, default_duration_s: float = 1.0, ewma_alpha: float = 0.2,
                 max_queue: int = 100_000, retain_s: float = 600.0, tick_s: float = 0.25,
                 order: Mapping[str, str] | None = None, max_wait_s: float = 60.0,
                 overdue_floor_s: float = 10.0) -> None:
        """``order``: resources whose queued actions are ordered otherwise than ``policy`` ("hrrs": the cycle's
        setup-aware order, with ``max_wait_s`` and ``overdue_floor_s``)."""
        self.managers = list(managers)
        self.store = store
        durations = DurationModel(alpha=ewma_alpha, default_s=default_duration_s)
        self.cycle = Cycle(self.managers, Scheduler(self.managers, durations, depth=depth, horizon=horizon),
                           make_queue(policy), arrivals=ArrivalModel(alpha=ewma_alpha),
                           hrrs=[resource for resource, name in (order or {}).items() if name == "hrrs"],
                           max_wait_s=max_wait_s, overdue_floor_s=overdue_floor_s)
        self.owner = self.cycle.owner
        self.executor = self.cycle.executor
        self.queue = self.cycle.queue
        self.durations = durations
        self.ledger = self.cycle.ledger
        self.metrics = Metrics()
        self.metrics.watch(lambda: dict(self.queue.depth_by_resource()), self._units)
        for manager in self.managers:
            manager.register_metrics(self.metrics.registry)
        self.max_queue = max_queue
        self.retain_s = retain_s
        self.tick_s = tick_s
        self.actions: dict[str, Action] = {}
        self.running: dict[str, _Running] = {}
        #: resizes being applied (kept here: asyncio holds tasks only weakly), and the shrinks among them, which
        #: starts wait for before using the units they free
        self._resizing: set[asyncio.Task[None]] = set()
        self._shrinking: set[asyncio.Task[None]] = set()
        self.leases = Leases(store, self.ledger)
        self.idempotency = IdempotencyIndex()
        self.recent: collections.deque[Action] = collections.deque(maxlen=1000)
        self._forget: collections.deque[tuple[float, str]] = collections.deque()
        self._waiters: dict[str, asyncio.Event] = {}
        self.passes = 0  # scheduling passes run (coalescing makes this far smaller than submits + completions)
        self._seq = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
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
        triaged = triage(await self.store.load_unfinished(), lambda action: self._validate(action, ""))
        for action, error in triaged.ended:
            self._remember(action)
            self._finish(action, State.FAILED, error=error)
        for action in triaged.resumed:
            self._remember(action)
            self.cycle.enqueue(action)
        regranted = await self.leases.regrant(self.executor.get(Kind.LEASE))
        for action in regranted:
            self._remember(action)
        self.kick()
        if triaged.resumed or triaged.ended or regranted:
            log.warning("recovered from the store: %d queued actions resumed, %d unfinished ones ended failed, "
                        "%d leases held again", len(triaged.resumed), len(triaged.ended), len(regranted))

    def _remember(self, action: Action) -> None:
        """Hold a recovered action's record in memory and under its idempotency key."""
        self.actions[action.id] = action
        self.idempotency.remember(action)

    async def drain(self, timeout_s: float) -> int:
        """Stop taking and starting actions and give the running ones up to ``timeout_s`` to finish; the queued ones
        stay in the store for the next start. Returns how many were still running at the bound (``close``
        cancels them)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            tasks = [r.task for r in self.running.values() if r.task is not None]
            if not tasks:
                break
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for event in self._waiters.values():  # long polls on queued actions answer now (202), not at their timeout
            event.set()
        if self.running or len(self.queue):
            log.warning("drained: %d actions still running at the %.0f s bound, %d queued ones kept for the next "
                        "start", len(self.running), timeout_s, len(self.queue))
        return len(self.running)

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for running in list(self.running.values()):
            if running.task is not None:
                running.cancel_reason = State.CANCELLED
                running.task.cancel()
        pending = [r.task for r in self.running.values() if r.task is not None]
        await asyncio.gather(*self._tasks, *pending, *self._resizing, return_exceptions=True)
        self.store.save_profiles(self.durations.take_dirty())
        self.store.save_speedups(self.durations.take_dirty_runs())
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
                self._validate(action, f"actions[{index}]." if len(actions) > 1 else "")
        if self.ledger.limited:  # after the last await: nothing is queued between the check and the pushes
            self._check_caps(actions, replayed)
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
            self.actions[action.id] = action
            self.idempotency.remember(action)
            self.cycle.submit(action, action.submitted_at)
            self.metrics.count_submit(action)
            results.append((action, True))
            fresh.append(action)
        if fresh:
            self.kick()
            try:
                await asyncio.gather(*(self.store.durable(a) for a in fresh))
            except Exception as error:  # noqa: BLE001 - queued and still pending in the store, which keeps retrying
                log.error("submit not durable yet: %r", error)
                raise Unavailable("store", "accepted but not yet durable (database unavailable); resubmit with "
                                           "the same idempotency_key to learn its fate") from None
        return results

    def _check_caps(self, actions: Sequence[Action], replayed: Sequence[Action | None]) -> None:
        """The per-task caps on what this submit would newly queue (idempotent replays, ``replayed``, and repeated
        keys within the submit count once); raises ``OverCap`` (429) before anything is queued."""
        fresh: list[Action] = []
        keys: set[tuple[str, str]] = set()
        for action, earlier in zip(actions, replayed, strict=True):
            if earlier is not None:
                continue
            if action.idempotency_key is not None:
                if (action.task, action.idempotency_key) in keys:
                    continue
                keys.add((action.task, action.idempotency_key))
            fresh.append(action)
        self.ledger.check_submit(fresh, self.environment_host, self._retry_after)

    def _retry_after(self, task: str) -> int:
        """Seconds until one of ``task``'s queued actions can expect to start: the soonest expected end among its
        running ones (at least 1 s, at most ``MAX_RETRY_S``; 1 s when none runs)."""
        now = time.time()
        ends = [(r.action.started_at or now) + (r.action.expected_duration_s or self.durations.default_s) - now
                for r in self.running.values() if r.action.task == task]
        return min(MAX_RETRY_S, max(1, math.ceil(min(ends)))) if ends else 1

    @property
    def environment_host(self) -> EnvironmentHost | None:
        """The manager keeping per-task environments (the CPU manager), if this broker has one."""
        return self.cycle.environment_host

    def set_tenancy(self, tenancy: Tenancy) -> None:
        """New per-task caps, from now on (a lowered cap takes nothing away; it stops what would pass it)."""
        self.ledger.tenancy = tenancy
        self.kick()

    def _validate(self, action: Action, where: str) -> None:
        if action.kind not in self.executor:
            raise Unprocessable(where + "kind", f"no manager on this broker executes {action.kind.value!r} actions")
        for resource in action.demands:
            if resource not in self.owner:
                raise BadRequest(f"{where}demand.{resource}",
                                 f"unknown resource; this broker has {sorted(self.owner)}")
            manager = self.owner[resource]
            if manager.largest_pool(resource) == 0:  # its nodes join, or come back, from the Ray cluster
                raise Unavailable(f"{where}demand.{resource}", f"no {resource} node is in service now; retry once "
                                                              f"one has joined or come back", retry_after_s=5)
            if action.demands[resource].min > manager.largest_pool(resource):
                raise Unprocessable(f"{where}demand.{resource}",
                                    f"minimum {action.demands[resource].min} units can never fit: the largest "
                                    f"pool has {manager.largest_pool(resource)}")
        try:
            self.executor[action.kind].validate(action)
            for manager in {id(self.owner[r]): self.owner[r] for r in action.demands}.values():
                if manager is not self.executor[action.kind]:
                    manager.validate(action)
        except RequestError as error:
            if where:
                error.field = where + error.field
            raise

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
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass
        return action

    async def cancel(self, action_id: str) -> Action:
        action = await self.get(action_id)
        if action.state.terminal:
            raise Conflict("id", f"action is already {action.state.value}")
        if self.cycle.dequeue(action_id) is not None:
            self._finish(action, State.CANCELLED, error={"code": "cancelled", "message": "cancelled by client"})
        else:
            running = self.running.get(action_id)
            if running is None:  # only a record in the store: nothing of it runs in this process
                raise Conflict("id", f"action is {action.state.value} but not running in this broker")
            running.cancel_reason = State.CANCELLED
            if running.task is not None:
                running.task.cancel()
                await asyncio.gather(running.task, return_exceptions=True)
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
        if self.draining or not (len(self.queue) or self.malleable_running):
            return 0
        self.passes += 1
        now = time.time()
        plan = self.cycle.pass_once(now, [r.action for r in self.running.values()],
                                    lambda plan: self._apply(plan, now))
        return len(plan.placements)

    def _apply(self, plan: Plan, now: float) -> None:
        self.metrics.schedule_pass.observe(self.cycle.last_pass_s)
        for decision in plan.shrinks():
            self._shrinking.add(self._resize(decision, now))
        after = frozenset(self._shrinking)
        for placement in plan.placements:
            self._start(placement, now, after)
        for decision in plan.grows():
            self._resize(decision, now)

    @property
    def malleable_running(self) -> bool:
        return any(r.action.malleable is not None for r in self.running.values())

    def _resize(self, decision: Resize, now: float) -> asyncio.Task[None]:
        """Resize in the books now and apply it in a task; an action that cannot be moved is ended
        ``resize_failed`` (its units are released when its execution ends, as for any end)."""
        running = self.running[decision.action.id]
        allocation = self.cycle.resize(running.allocations, decision, now)
        self.metrics.resizes.inc()
        task = asyncio.create_task(self._apply_resize(running, self.owner[decision.resource], allocation),
                                   name=f"tangram-resize-{decision.action.id}")
        self._resizing.add(task)
        task.add_done_callback(self._resizing.discard)
        task.add_done_callback(self._shrinking.discard)
        return task

    async def _apply_resize(self, running: _Running, manager: ResourceManager, allocation: Allocation) -> None:
        try:
            await manager.apply_resize(allocation)
        except ActionFailed as failure:
            log.warning("resizing %s failed: %s", running.action.id, failure.message)
            error = failure.to_json()
        except Exception as bug:  # a manager bug: end this action, keep the broker up
            log.exception("resizing %s failed", running.action.id)
            error = {"code": "resize_failed", "message": repr(bug)}
        else:
            return
        self.cycle.scheduler.reshare()
        if running.task is not None and not running.task.done():
            running.failure = error
            running.task.cancel()

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
        outcome = executor.complete_now(action, own)
        if outcome is not None:
            action.execution_s = 0.0
            if outcome.hold:
                self.ledger.hold(action)
            self._finish(action, State.SUCCEEDED, result=outcome.result, keep=allocations if outcome.hold else None)
            if not outcome.hold:
                dispatch.release(allocations)
            return
        running = _Running(action, allocations, own, after)
        self.running[action.id] = running
        self.ledger.hold(action)
        self.store.save(action)
        running.task = asyncio.create_task(self._execute(running), name=f"tangram-{action.id}")

    async def _execute(self, running: _Running) -> None:
        action = running.action
        manager = self.executor[action.kind]
        hold = False
        began = time.time()
        remaining = action.submitted_at + action.timeout_s - began
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                if running.after:  # asyncio.wait, unlike gather, leaves the shrinks running if this is cancelled
                    await asyncio.wait(running.after)
                    running.after = frozenset()
                outcome = await manager.execute(action, running.allocation)
            hold = outcome.hold
            action.execution_s = time.time() - began
            self._finish(action, State.SUCCEEDED, result=outcome.result, keep=running.allocations if hold else None)
        except TimeoutError:
            action.execution_s = time.time() - began
            self._finish(action, State.TIMED_OUT, error={"code": "timed_out",
                                                         "message": f"deadline of {action.timeout_s} s passed"})
        except asyncio.CancelledError:
            action.execution_s = time.time() - began
            if running.failure is not None and running.cancel_reason is None:
                self._finish(action, State.FAILED, error=running.failure)
            else:
                reason = running.cancel_reason or State.CANCELLED
                message = "broker shutting down" if self._closing else "cancelled by client"
                self._finish(action, reason, error={"code": reason.value, "message": message})
        except ActionFailed as failure:
            action.execution_s = time.time() - began
            state = State.TIMED_OUT if failure.code == "timed_out" else State.FAILED
            self._finish(action, state, error=failure.to_json())
        except Exception as error:  # a manager bug: fail this action, keep the broker up
            log.exception("executing %s failed", action.id)
            action.execution_s = time.time() - began
            self._finish(action, State.FAILED, error={"code": "internal", "message": repr(error)})
        finally:
            self.running.pop(action.id, None)
            if not hold:
                dispatch.release(running.allocations)
                self.ledger.unhold(action)
            self.kick()

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
        self.recent.append(action)
        self._forget.append((action.finished_at, action.id))
        event = self._waiters.pop(action.id, None)
        if event is not None:
            event.set()

    def _return_lease(self, action: Action, how: str) -> None:
        self.leases.give_back(action, how)
        self._forget.append((time.time(), action.id))  # memory kept it past ``retain_s`` while it was held
        self.kick()

    # -- time-driven work -----------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            delay = self.tick_s
            for manager in self.managers:
                hint = manager.next_change_in()
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
                    "code": "timed_out", "message": f"still queued when its deadline of {action.timeout_s} s passed"})
        while self._forget and self._forget[0][0] + self.retain_s < now:
            _, action_id = self._forget.popleft()
            if action_id not in self.leases:
                action = self.actions.pop(action_id, None)
                if action is not None:
                    self.idempotency.forget(action)
        if self.durations.dirty:  # a run of a speed-up model is always a profile's sample too
            self.store.save_profiles(self.durations.take_dirty())
            self.store.save_speedups(self.durations.take_dirty_runs())
        self.kick()

    # -- views ------------------------------------------------------------------------------------------

    def _units(self) -> Iterable[tuple[str, str, int, int]]:
        for manager in self.managers:
            for row in manager.status():
                yield row.resource, row.pool, row.capacity, row.in_use

    def resources(self) -> list[dict[str, Any]]:
        depth = self.queue.depth_by_resource()
        rows = []
        for manager in self.managers:
            for row in manager.status():
                rows.append({"resource": row.resource, "pool": row.pool, "manager": manager.name,
                             "capacity": row.capacity, "in_use": row.in_use, "queued": depth.get(row.resource, 0),
                             **row.extra})
        return rows

    def stats(self) -> dict[str, Any]:
        """Counts and recent ACT percentiles, for ``tangram status`` and the status page."""
        acts = sorted(a.timings()["act_s"] or 0.0 for a in self.recent)

        def pct(q: float) -> float | None:
            return acts[min(len(acts) - 1, int(q * len(acts)))] if acts else None

        return {"queued": len(self.queue), "running": len(self.running), "leases": len(self.leases),
                "recent": len(acts), "act_p50_s": pct(0.5), "act_p90_s": pct(0.9), "act_p99_s": pct(0.99)}
