"""The seam between the scheduler and everything topology-specific (the paper's standardized interface).

The scheduler never learns what a container, a GPU or an API is. It sees, per manager:

* ``resources`` — resource names and their capacity;
* ``fit()`` — a scratch copy of the free capacity on which a scheduling pass places candidates at their minimum
  units one by one (topology-aware ``accommodate``) and learns which *pool* (node, GPU group, ...) holds each
  placed action's resources; the pass's elastic DP then runs per (resource, pool), with the fit's
  ``dp_operator`` for that pool's topology;
* ``allocate`` / ``release`` — turn "k units of R in pool p" into a concrete placement and back;
* ``execute`` — run an action on its allocation and return its result.

What a manager adds to the scheduling cycle beyond these verbs (a setup cost for HRRS, a look at the queue after each
pass, a view of every action) it offers as ``plugins``, which the cycle (``tangram/sched/cycle.py``) runs at its
extension points.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from tangram.core.action import Action, Kind
from tangram.core.dparrange import BasicOperator, DPOperator
from tangram.core.malleable import WorkerCost, Workers


class MetricsRegistry(Protocol):
    """Where a manager registers its metrics: a ``prometheus_client.CollectorRegistry`` (named by shape here, so
    the seam does not import the exporter)."""

    def register(self, collector: Any) -> None: ...


class ActionWatcher(Protocol):
    """Told of every action a submit queues and of every action's end (``tangram/slo/attainment.py``,
    ``managers/gpu/service_demand.py``)."""

    def submitted(self, action: Action) -> None: ...

    def ended(self, action: Action) -> None: ...


class Foresight(Protocol):
    """Told after each pass of the actions still queued, in the order they will run (the GPU manager prefetches
    host copies from its disk tier for them). Must not block."""

    @property
    def foresees(self) -> bool:
        """Whether it wants the queue now (the cycle then keeps the pass's order to tell it)."""

    def foresee(self, upcoming: Iterable[Action]) -> None: ...


class ReserveOrder(Protocol):
    """Puts the queued actions owed reserved units ahead of the rest, given what runs now (SLO admission's
    reserved GPU shares, ``tangram/sched/reserved_shares.py``)."""

    def order(self, queue: Iterable[Action], running: Iterable[Action]) -> Iterable[Action]: ...


class EnvironmentHost(Protocol):
    """A manager that keeps per-task environments (the CPU manager's sandboxes): what the per-task environment and
    memory caps count (``tangram/sched/tenants.py``), and which trajectories are still open (the arrival model)."""

    def environment_demand(self, action: Action) -> int | None:
        """MiB of the environment ``action`` would create if it started now; None if it needs none."""

    def task_usage(self, task: str) -> tuple[int, int]:
        """The task's environments and the MiB they reserve."""

    def holds_environment(self, task: str, trajectory: str) -> bool:
        """Whether the trajectory still has its environment (it has not ended): its next action is to come."""


@dataclass(frozen=True, slots=True)
class CyclePlugins:
    """What a manager, or a feature built beside the managers (SLO admission), adds to the scheduling cycle and the
    loop around it; each absent by default."""

    #: seconds each action (by id) would spend getting the manager's resource ready if it started now (a GPU
    #: service's restore when it is not resident), for a setup-aware queue order (HRRS); absent from the dict: none
    setup_costs: Callable[[Sequence[Action]], dict[str, float]] | None = None
    foresight: Foresight | None = None
    #: the order after the queue order: actions owed reserved units first (at most one in a cycle)
    reserve_order: ReserveOrder | None = None
    #: what the manager learns from every action queued and ended, not only those it runs (the GPU manager's
    #: demand per service)
    watchers: Sequence[ActionWatcher] = ()
    #: seconds until capacity frees up by itself (quota windows, a restore ending); None if never: the loop that
    #: drives the cycle wakes for it
    next_change_in: Callable[[], float | None] | None = None
    #: adds the manager's own Prometheus metrics (restores, evictions, ...) to the broker's registry
    metrics: Callable[[MetricsRegistry], None] | None = None
    #: the environments the per-task caps count, for the environment-caps filter and the submit checks (at most
    #: one in a cycle)
    environments: EnvironmentHost | None = None


#: what a manager keeps in its allocations to find their resources again (the CPU manager: environment, node and
#: cores; the GPU manager: node and chunk); typed per manager, so only the manager that made a handle reads it
Handle = TypeVar("Handle")


@dataclass(slots=True)
class Allocation(Generic[Handle]):
    """Concrete resources granted to one action. ``placement`` is shown to clients; ``handle`` is private."""

    action_id: str
    units: dict[str, int]
    pools: dict[str, str]
    placement: dict[str, Any] = field(default_factory=dict)
    handle: Handle | None = None
    released: bool = False

    def held(self) -> Handle:
        """The handle its manager set; reading one that was never set is a bug of that manager."""
        if self.handle is None:
            raise RuntimeError(f"the allocation of {self.action_id} has no handle")
        return self.handle


@dataclass(slots=True)
class Outcome:
    """What ``execute`` returns. ``hold=True`` keeps the allocation after completion (a lease) until released."""

    result: Any
    hold: bool = False
    #: seconds of the execution spent making the resource ready (a GPU service's restore), which depend on where
    #: the action ran, not on the action: the broker records it on the action, and duration models leave it out
    restore_s: float | None = None


@dataclass(slots=True)
class PoolStatus:
    """One row of ``GET /v1/resources``."""

    resource: str
    pool: str
    capacity: int
    in_use: int
    extra: dict[str, Any] = field(default_factory=dict)


class Fit(abc.ABC):
    """A tentative placement of candidates at minimum units, private to one scheduling pass."""

    @abc.abstractmethod
    def try_add(self, action: Action, units: Mapping[str, int]) -> bool:
        """Place ``units`` (this manager's resources only) for ``action`` if the real topology allows it now.

        Must leave the fit unchanged when it returns False.
        """

    @abc.abstractmethod
    def remove(self, action: Action) -> None:
        """Undo a successful ``try_add`` (used when another manager refuses the same action)."""

    @abc.abstractmethod
    def pool_of(self, action: Action, resource: str) -> str:
        """The pool in which ``try_add`` placed ``resource`` for ``action``."""

    @abc.abstractmethod
    def free_before(self, resource: str, pool: str) -> int:
        """Free units of ``resource`` in ``pool`` before any candidate of this pass was placed."""

    def holds_back(self, action: Action) -> bool:
        """Whether ``action``, just refused by ``try_add``, keeps later actions off its resources this pass (FCFS).

        False when what it lacks is something those actions do not need: then letting them go cannot delay it."""
        return True

    def lend(self, resource: str, pool: str, units: int) -> None:
        """Count ``units`` of ``resource`` in ``pool``, held by a running malleable action above its floor, as free
        for this pass: queued actions may take them (the action is shrunk). Only resizable managers are asked."""
        raise NotImplementedError(f"{type(self).__name__} does not lend units of {resource!r}")

    def pools(self, resource: str) -> Sequence[str]:
        """Every pool that holds ``resource`` (one pool, ``default``, unless the topology has several)."""
        return ("default",)

    def dp_operator(self, resource: str, pool: str, others: Sequence[Action]) -> DPOperator:
        """The DPArrange operator for what ``pool`` leaves an elastic group once ``others`` (this pass's other
        candidates placed there) hold their minimum. Plain counted units by default (``next(j, k) = j + k``)."""
        return BasicOperator()


class Resizing(abc.ABC, Generic[Handle]):
    """How running allocations of one resource change size (``ResourceManager.resizing``): the scheduler lends their
    units above the floor to queued actions and shares spare units among them (``tangram/core/malleable.py``)."""

    def workers(self, action: Action, units: int, expected_s: float, learned: WorkerCost | None = None) -> Workers:
        """The workers a malleable action started on ``units`` gets (the most units it can later use, or the cap
        of workers that follow its units); ``learned``: what its workers were seen to cost, when its signature has
        run with several."""
        return Workers(units)

    @abc.abstractmethod
    def resize(self, allocation: Allocation[Handle], units: int) -> None:
        """Change a running allocation to ``units`` in the same pool, in the books at once: units given up are free
        for the next allocation, units added are taken. ``apply`` makes it real."""

    @abc.abstractmethod
    async def apply(self, allocation: Allocation[Handle]) -> None:
        """Move the running action onto its allocation's current units. Raise ``ActionFailed`` if it cannot: the
        caller then ends the action (a shrink that did not happen must not leave two actions on one unit)."""


class ResourceManager(abc.ABC, Generic[Handle]):
    """Owns some resource types: their capacity, topology, allocation and the execution of some action kinds."""

    name: str = "manager"
    #: action kinds this manager executes (at most one manager per kind)
    kinds: frozenset[Kind] = frozenset()
    #: the typed ``spec`` of each kind it executes: the API document shows it, ``validate`` parses it
    spec_types: Mapping[Kind, type] = MappingProxyType({})

    @property
    @abc.abstractmethod
    def resources(self) -> Mapping[str, int]:
        """Resource name -> total capacity in units (over all pools)."""

    @abc.abstractmethod
    def largest_pool(self, resource: str) -> int:
        """The most units of ``resource`` one action could ever get; larger minimum demands are rejected."""

    @abc.abstractmethod
    def fit(self) -> Fit:
        """A fresh scratch copy of current free capacity."""

    @abc.abstractmethod
    def allocate(self, action: Action, units: Mapping[str, int], pools: Mapping[str, str]) -> Allocation[Handle]:
        """Grant ``units`` in ``pools`` (this manager's resources only). The scheduler only asks for what fits."""

    @abc.abstractmethod
    def release(self, allocation: Allocation[Handle]) -> None:
        """Return an allocation's units. Idempotent."""

    def resizing(self, resource: str) -> Resizing[Handle] | None:
        """How running allocations of ``resource`` change size; None when they cannot (elastic actions on it are
        then moldable, not malleable)."""
        return None

    async def execute(self, action: Action, allocation: Allocation[Handle]) -> Outcome:
        """Run ``action`` on ``allocation``. Raise ``ActionFailed`` for expected failures."""
        raise NotImplementedError(f"{self.name} executes no actions")

    def validate(self, action: Action) -> None:
        """Reject at submit what this manager could never run (raise ``BadRequest`` naming the field)."""

    @abc.abstractmethod
    def status(self) -> list[PoolStatus]:
        """Capacity and use per resource and pool."""

    def plugins(self) -> CyclePlugins:
        """What this manager adds to the scheduling cycle and the loop around it (asked once, when the cycle is
        built)."""
        return CyclePlugins()

    async def start(self) -> None:
        """Open connections, start background work."""

    async def close(self) -> None:
        """Stop background work and free what ``start`` opened."""


@runtime_checkable
class Lessor(Protocol):
    """A manager whose ``lease`` actions hold units after they succeed (``Outcome.hold``) until returned or expired.

    The broker asks it which leases expired, and after a restart has it hold again the leases a previous process
    granted and nobody returned: the clients still use those units."""

    def grant(self, action: Action, allocation: Allocation[Any]) -> Outcome:
        """Grant a ``lease`` action at once: it needs no I/O, so the broker finishes it without a task (the hottest
        path: thousands of grants a second). The allocation is held until the lease is returned or expires."""

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Ids of the leases whose TTL has passed and that are not released yet."""

    def longest_lease_s(self) -> float:
        """The longest TTL a lease can have here: older grants cannot be held any more."""

    def regrant(self, action: Action, remaining_s: float) -> Allocation[Any] | None:
        """Hold ``action.units`` again for the ``remaining_s`` of the lease's TTL, even past today's capacity (the
        units are in use whatever the config says now); None if a resource it holds no longer exists here."""
