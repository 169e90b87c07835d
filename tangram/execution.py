"""Running what a pass started: one asyncio task per action on its allocations, and resizes applied while it runs.

The broker decides (the cycle's plan) and records (its ``finish``); this runs. An action's task first waits for the
shrinks in flight when it started (the units it took may still be in use until they are applied), then runs the
executor within the action's deadline, and reports the end once; the units go back then, unless the outcome holds
them (a lease).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tangram.core.action import Action, State
from tangram.core.errors import ActionFailed
from tangram.core.seam import Allocation, Resizing, ResourceManager
from tangram.log_context import bound_action
from tangram.sched import dispatch
from tangram.sched.cycle import Cycle
from tangram.sched.scheduler import Resize

log = logging.getLogger("tangram.broker")

Allocations = list[tuple[ResourceManager, Allocation]]


class Finish(Protocol):
    """Records an action's end (the broker's): ``keep`` holds its allocations past the end (a lease)."""

    def __call__(self, action: Action, state: State, *, result: Any = None, error: dict[str, Any] | None = None,
                 keep: Allocations | None = None) -> None: ...


class Running:
    """An action being executed: every manager's allocation, and the executor's own (empty if it owns none)."""

    __slots__ = ("action", "after", "allocation", "allocations", "cancel_reason", "failure", "task")

    def __init__(self, action: Action, allocations: Allocations, allocation: Allocation,
                 after: frozenset[asyncio.Task[None]]) -> None:
        self.action = action
        self.allocations = allocations
        self.allocation = allocation
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason: State | None = None
        self.failure: dict[str, Any] | None = None  # why it was ended from outside (a resize that failed)
        #: the shrinks in flight when it started: units it took may still be in use until they are applied
        self.after = after


class Executions:
    """The actions running in this process, and the resizes being applied to them."""

    def __init__(self, cycle: Cycle, finish: Finish, kick: Callable[[], None],
                 resized: Callable[[], None]) -> None:
        """``kick``: asks for a pass (an end frees units); ``resized``: counts a resize (the broker's metric)."""
        self.cycle = cycle
        self.finish = finish
        self.kick = kick
        self.resized = resized
        self.running: dict[str, Running] = {}
        #: resizes being applied (kept here: asyncio holds tasks only weakly), and the shrinks among them, which
        #: starts wait for before using the units they free
        self._resizing: set[asyncio.Task[None]] = set()
        self._shrinking: set[asyncio.Task[None]] = set()
        self.closing = False

    @property
    def malleable_running(self) -> bool:
        return any(r.action.malleable is not None for r in self.running.values())

    def shrinks_in_flight(self) -> frozenset[asyncio.Task[None]]:
        return frozenset(self._shrinking)

    def run(self, action: Action, allocations: Allocations, allocation: Allocation,
            after: frozenset[asyncio.Task[None]]) -> None:
        """Execute ``action`` on ``allocation`` (its executor's) in a task of its own."""
        running = Running(action, allocations, allocation, after)
        self.running[action.id] = running
        with bound_action(action):  # the task copies the context: its log lines name the action
            running.task = asyncio.create_task(self._execute(running), name=f"tangram-{action.id}")

    def shrink(self, decision: Resize, now: float) -> None:
        self._shrinking.add(self.resize(decision, now))

    def resize(self, decision: Resize, now: float) -> asyncio.Task[None]:
        """Resize in the books now and apply it in a task; an action that cannot be moved is ended
        ``resize_failed`` (its units are released when its execution ends, as for any end)."""
        running = self.running[decision.action.id]
        allocation = self.cycle.resize(running.allocations, decision, now)
        self.resized()
        resizing = self.cycle.owner[decision.resource].resizing(decision.resource)
        assert resizing is not None  # the cycle resized it in the books
        with bound_action(decision.action):
            task = asyncio.create_task(self._apply_resize(running, resizing, allocation),
                                       name=f"tangram-resize-{decision.action.id}")
        self._resizing.add(task)
        task.add_done_callback(self._resizing.discard)
        task.add_done_callback(self._shrinking.discard)
        return task

    async def wait(self, timeout_s: float) -> None:
        """Until every running action has ended, or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            tasks = [r.task for r in self.running.values() if r.task is not None]
            if not tasks:
                return
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))

    async def cancel(self, action_id: str) -> bool:
        """End a running action as cancelled by its client; False if it does not run in this process."""
        running = self.running.get(action_id)
        if running is None:
            return False
        running.cancel_reason = State.CANCELLED
        if running.task is not None:
            running.task.cancel()
            await asyncio.gather(running.task, return_exceptions=True)
        return True

    async def close(self) -> None:
        """Cancel every running action (each ends cancelled: the broker is shutting down) and wait for them and
        for the resizes in flight."""
        self.closing = True
        for running in list(self.running.values()):
            if running.task is not None:
                running.cancel_reason = State.CANCELLED
                running.task.cancel()
        pending = [r.task for r in self.running.values() if r.task is not None]
        await asyncio.gather(*pending, *self._resizing, return_exceptions=True)

    async def _apply_resize(self, running: Running, resizing: Resizing[Any], allocation: Allocation) -> None:
        try:
            await resizing.apply(allocation)
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

    async def _execute(self, running: Running) -> None:
        action = running.action
        manager = self.cycle.executor[action.kind]
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
            action.restore_s = outcome.restore_s
            self.finish(action, State.SUCCEEDED, result=outcome.result, keep=running.allocations if hold else None)
        except TimeoutError:
            action.execution_s = time.time() - began
            self.finish(action, State.TIMED_OUT, error={"code": "timed_out", "limit": "timeout_s",
                                                        "message": f"deadline of {action.timeout_s} s passed"})
        except asyncio.CancelledError:
            action.execution_s = time.time() - began
            if running.failure is not None and running.cancel_reason is None:
                self.finish(action, State.FAILED, error=running.failure)
            else:
                reason = running.cancel_reason or State.CANCELLED
                message = "broker shutting down" if self.closing else "cancelled by client"
                self.finish(action, reason, error={"code": reason.value, "message": message})
        except ActionFailed as failure:
            action.execution_s = time.time() - began
            action.restore_s = failure.restore_s
            state = State.TIMED_OUT if failure.code == "timed_out" else State.FAILED
            self.finish(action, state, error=failure.to_json())
        except Exception as error:  # a manager bug: fail this action, keep the broker up
            log.exception("executing %s failed", action.id)
            action.execution_s = time.time() - began
            self.finish(action, State.FAILED, error={"code": "internal", "message": repr(error)})
        finally:
            self.running.pop(action.id, None)
            if not hold:
                dispatch.release(running.allocations)
                self.cycle.ledger.unhold(action)
            self.kick()
