"""Per-task caps, so that one RL task's burst cannot starve the others sharing the broker.

Five caps, each unlimited unless configured (``[tasks]`` for every task, ``[tasks.NAME]`` for one) or, while
auth is on (tenants then need not trust each other), ``AUTHENTICATED_DEFAULTS`` where the config sets none:

* ``max_running``: actions of the task holding resources at once (executing, or a granted lease not yet returned).
  Enforced by the scheduling pass: the task's actions beyond the cap are left out of the pass, so they stay
  queued in their order and block nothing that other tasks' later actions need.
* ``max_queued``: actions of the task waiting in the queue; a submit beyond gets 429 with ``Retry-After``.
* ``max_queued_bytes``: the bytes of their specs (files and commands the broker holds for them), the same way.
* ``max_environments`` / ``max_memory_mb``: sandboxes of the task and the memory they reserve, counting those its
  queued actions will create; a submit or ``POST /v1/environments`` that needs one more beyond gets 429, and the
  scheduling pass starts no action that would create one beyond (another request may have taken the room since).

``TaskLedger`` keeps the per-task counts the broker needs to check them cheaply. The cycle owns it: its
``admissible`` is the pass's first queue filter, and submits are checked against the same counts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields

import orjson

from tangram.core.action import Action
from tangram.core.config_tables import TABLE, NonNegative
from tangram.core.errors import TooMany
from tangram.core.seam import EnvironmentHost

#: Retry-After for an environment or memory cap: room comes back when the task's sandboxes are deleted or idle out,
#: which the broker cannot foresee
ENVIRONMENT_RETRY_S = 5
#: the longest Retry-After the broker suggests for a full per-task queue
MAX_RETRY_S = 60


@dataclass(frozen=True, slots=True)
class TaskCaps:
    """One task's caps; ``None`` is unlimited, 0 stops the task."""

    __pydantic_config__ = TABLE

    max_running: NonNegative | None = None
    max_queued: NonNegative | None = None
    max_queued_bytes: NonNegative | None = None
    max_environments: NonNegative | None = None
    max_memory_mb: NonNegative | None = None

    def over(self, defaults: TaskCaps) -> TaskCaps:
        """These caps, with ``defaults`` for the ones not set here."""
        return TaskCaps(*(getattr(self, f.name) if getattr(self, f.name) is not None else getattr(defaults, f.name)
                          for f in fields(self)))

    @property
    def limits_environments(self) -> bool:
        return self.max_environments is not None or self.max_memory_mb is not None

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))


CAP_NAMES = tuple(f.name for f in fields(TaskCaps))
#: a task's caps while auth is on, where the config sets none: one tenant's queue cannot fill the broker's memory
AUTHENTICATED_DEFAULTS = TaskCaps(max_queued=50_000, max_queued_bytes=1 << 30)


@dataclass(frozen=True)
class Tenancy:
    """The caps of every task: ``defaults`` for all, ``tasks`` overriding some of them per task."""

    defaults: TaskCaps = TaskCaps()
    tasks: Mapping[str, TaskCaps] = field(default_factory=dict)

    def caps(self, task: str) -> TaskCaps:
        own = self.tasks.get(task)
        return own.over(self.defaults) if own is not None else self.defaults

    @property
    def limited(self) -> bool:
        return not self.defaults.unlimited or any(not caps.unlimited for caps in self.tasks.values())


class OverCap(TooMany):
    """A task is at one of its caps; ``retry_after_s`` says when trying again makes sense."""

    def __init__(self, task: str, cap: str, limit: int, reason: str, retry_after_s: int) -> None:
        super().__init__("task", reason, retry_after_s, cap=cap, limit=limit)
        self.task = task


def spec_bytes(action: Action) -> int:
    """What the broker holds for a queued action: its spec, as JSON."""
    return len(orjson.dumps(action.spec))


def _new_environments(actions: Iterable[Action], host: EnvironmentHost,
                      seen: set[object] | None = None) -> list[int]:
    """MiB of each environment ``actions`` would create, one per trajectory (``seen`` holds trajectories already
    counted and is extended)."""
    seen = set() if seen is None else seen
    memory: list[int] = []
    for action in actions:
        need = host.environment_demand(action)
        if need is None:
            continue
        key: object = (action.task, action.trajectory) if action.trajectory is not None else action.id
        if key not in seen:
            seen.add(key)
            memory.append(need)
    return memory


@dataclass(slots=True)
class _PassBudget:
    running: float
    environments: float
    memory_mb: float
    admitted: set[object] = field(default_factory=set)


class TaskLedger:
    """Per-task counts of queued actions and of actions holding resources, kept in step by the broker."""

    def __init__(self, tenancy: Tenancy = Tenancy()) -> None:
        self.tenancy = tenancy
        #: whether auth is on now (the API sets it): then ``AUTHENTICATED_DEFAULTS`` stand where the config is silent
        self.authenticated: Callable[[], bool] = lambda: False
        self.queued: dict[str, dict[str, Action]] = {}
        self.queued_bytes: Counter[str] = Counter()
        self._spec_bytes: dict[str, int] = {}
        self.holding: Counter[str] = Counter()

    def caps(self, task: str) -> TaskCaps:
        caps = self.tenancy.caps(task)
        return caps.over(AUTHENTICATED_DEFAULTS) if self.authenticated() else caps

    @property
    def limited(self) -> bool:
        """Whether any cap can hold anything back (none configured and auth off: the checks are skipped)."""
        return self.tenancy.limited or self.authenticated()

    # -- bookkeeping ----------------------------------------------------------------------------------------

    def queue(self, action: Action) -> None:
        self.queued.setdefault(action.task, {})[action.id] = action
        size = self._spec_bytes[action.id] = spec_bytes(action)
        self.queued_bytes[action.task] += size

    def unqueue(self, action: Action) -> None:
        waiting = self.queued.get(action.task)
        if waiting is not None:
            waiting.pop(action.id, None)
            if not waiting:
                del self.queued[action.task]
        size = self._spec_bytes.pop(action.id, None)
        if size is not None:
            self.queued_bytes[action.task] -= size
            if self.queued_bytes[action.task] <= 0:
                del self.queued_bytes[action.task]

    def hold(self, action: Action) -> None:
        self.holding[action.task] += 1

    def unhold(self, action: Action) -> None:
        self.holding[action.task] -= 1
        if self.holding[action.task] <= 0:
            del self.holding[action.task]

    # -- checks at submit -----------------------------------------------------------------------------------

    def check_submit(self, actions: Sequence[Action], host: EnvironmentHost | None,
                     retry_after_s: Callable[[str], int]) -> None:
        """Raise ``OverCap`` if queueing ``actions`` (new ones, not idempotent replays) would take any task over its
        queued, queued-bytes, environment or memory cap; nothing is counted here, so a batch is all or nothing.
        ``retry_after_s(task)`` estimates when a full queue of the task will have room."""
        by_task: dict[str, list[Action]] = {}
        for action in actions:
            by_task.setdefault(action.task, []).append(action)
        for task, mine in by_task.items():
            caps = self.caps(task)
            if caps.max_queued_bytes is not None:
                queued_bytes = self.queued_bytes.get(task, 0)
                wanted = sum(map(spec_bytes, mine))
                if queued_bytes + wanted > caps.max_queued_bytes:
                    raise OverCap(task, "max_queued_bytes", caps.max_queued_bytes,
                                  f"task {task!r} has {queued_bytes} bytes of specs queued and its cap "
                                  f"max_queued_bytes is {caps.max_queued_bytes}; {wanted} more do not fit",
                                  retry_after_s(task))
            if caps.max_queued is not None:
                queued = len(self.queued.get(task, ()))
                if queued + len(mine) > caps.max_queued:
                    raise OverCap(task, "max_queued", caps.max_queued,
                                  f"task {task!r} has {queued} queued actions and its cap max_queued is "
                                  f"{caps.max_queued}; {len(mine)} more do not fit", retry_after_s(task))
            if host is not None and caps.limits_environments:
                self._check_environments(task, caps, host, mine)

    def check_environment(self, task: str, trajectory: str | None, memory_mb: int, host: EnvironmentHost) -> None:
        """``POST /v1/environments``: room for one more environment of ``memory_mb`` MiB, or ``OverCap``. Queued
        actions of ``trajectory`` would have created it: it is not counted twice."""
        self.check_environments(task, [trajectory], memory_mb, host)

    def check_environments(self, task: str, trajectories: list[str | None], memory_mb: int,
                           host: EnvironmentHost) -> None:
        """Room for one more environment of ``memory_mb`` MiB per trajectory (a fork's), or ``OverCap``."""
        caps = self.caps(task)
        if caps.limits_environments:
            seen: set[object] = {(task, trajectory) for trajectory in trajectories if trajectory is not None}
            pending = _new_environments(self.queued.get(task, {}).values(), host, seen)
            self._room(task, caps, host, pending, [memory_mb] * len(trajectories))

    def _check_environments(self, task: str, caps: TaskCaps, host: EnvironmentHost, actions: list[Action]) -> None:
        seen: set[object] = set()
        pending = _new_environments(self.queued.get(task, {}).values(), host, seen)
        wanted = _new_environments(actions, host, seen)  # trajectories the queue already creates are not new
        if wanted:
            self._room(task, caps, host, pending, wanted)

    @staticmethod
    def _room(task: str, caps: TaskCaps, host: EnvironmentHost, pending: list[int], wanted: list[int]) -> None:
        """``OverCap`` unless the task's environments, those its queue will create (``pending``) and ``wanted`` all
        fit its caps."""
        count, memory = host.task_usage(task)
        count += len(pending)
        memory += sum(pending)
        if caps.max_environments is not None and count + len(wanted) > caps.max_environments:
            raise OverCap(task, "max_environments", caps.max_environments,
                          f"task {task!r} has {count} environments (its queued actions' new ones included) and its "
                          f"cap max_environments is {caps.max_environments}; delete idle ones or wait for them to "
                          f"finish", ENVIRONMENT_RETRY_S)
        if caps.max_memory_mb is not None and memory + sum(wanted) > caps.max_memory_mb:
            raise OverCap(task, "max_memory_mb", caps.max_memory_mb,
                          f"task {task!r} reserves {memory} MiB in environments (its queued actions' new ones "
                          f"included); {sum(wanted)} MiB more would pass its cap max_memory_mb of "
                          f"{caps.max_memory_mb}", ENVIRONMENT_RETRY_S)

    # -- the scheduling pass ------------------------------------------------------------------------------------

    def admissible(self, queue: Iterable[Action], host: EnvironmentHost | None) -> Iterator[Action]:
        """The queue as a scheduling pass may see it: in order, without the actions a task's caps hold back.

        Each task's budget is what its caps leave now; an action passed on spends one running slot and, if it would
        create an environment, one environment and its memory. Actions left out are invisible to the pass, so
        they hold no resource back from other tasks' actions behind them.
        """
        budgets: dict[str, _PassBudget | None] = {}
        for action in queue:
            task = action.task
            if task not in budgets:
                budgets[task] = self._budget(task, host)
            budget = budgets[task]
            if budget is None:
                yield action
                continue
            if budget.running < 1:
                continue
            if host is not None and (budget.environments != math.inf or budget.memory_mb != math.inf):
                need = host.environment_demand(action)
                key: object = (task, action.trajectory) if action.trajectory is not None else action.id
                if need is not None and key not in budget.admitted:
                    if budget.environments < 1 or budget.memory_mb < need:
                        continue
                    budget.environments -= 1
                    budget.memory_mb -= need
                    budget.admitted.add(key)
            budget.running -= 1
            yield action

    def _budget(self, task: str, host: EnvironmentHost | None) -> _PassBudget | None:
        caps = self.caps(task)
        if caps.max_running is None and not (host is not None and caps.limits_environments):
            return None
        running = math.inf if caps.max_running is None else caps.max_running - self.holding.get(task, 0)
        environments = memory = math.inf
        if host is not None and caps.limits_environments:
            count, reserved = host.task_usage(task)
            if caps.max_environments is not None:
                environments = caps.max_environments - count
            if caps.max_memory_mb is not None:
                memory = caps.max_memory_mb - reserved
        return _PassBudget(running, environments, memory)
