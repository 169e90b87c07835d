"""The leases the broker holds for their clients: granted, then given back by the client (``released``), by the
lessor's TTL (``expired``), or held again after a restart until their original expiry.

A lease is an action that succeeded and kept its allocations: its units stay taken, and count against its task's
caps, until it is given back. Each way back is recorded on the action's result (``returned``, ``returned_at``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from tangram.core.action import Action, Kind, State
from tangram.core.errors import Conflict, NotFound
from tangram.core.seam import Allocation, Lessor, ResourceManager
from tangram.sched import dispatch
from tangram.sched.tenants import TaskLedger
from tangram.store.store import Store

Held = list[tuple[ResourceManager, Allocation]]


class Leases:
    """Held leases by action id, with what each holds."""

    def __init__(self, store: Store, ledger: TaskLedger) -> None:
        self._store = store
        self._ledger = ledger
        self._held: dict[str, Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, action_id: object) -> bool:
        return action_id in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def hold(self, action: Action, allocations: Held) -> None:
        """``action`` was granted: its allocations stay taken until it is given back."""
        self._held[action.id] = allocations

    def check_releasable(self, action: Action) -> None:
        """A client may give back only a lease that is held now."""
        if action.kind is not Kind.LEASE:
            raise NotFound("id", f"action {action.id!r} is not a lease")
        if action.id not in self._held:
            if action.state is State.SUCCEEDED:
                raise Conflict("id", "lease was already returned or expired")
            raise Conflict("id", f"lease is {action.state.value}, not granted")

    def give_back(self, action: Action, how: str) -> None:
        """Free what the lease holds and record how it came back (``released``, ``expired``)."""
        dispatch.release(self._held.pop(action.id))
        self._ledger.unhold(action)
        self.record_return(action, how, time.time())

    def record_return(self, action: Action, how: str, at: float) -> None:
        result = dict(action.result or {})
        result["returned"] = how
        result["returned_at"] = at
        action.result = result
        self._store.save(action)

    def expired(self, managers: Sequence[ResourceManager]) -> list[str]:
        """Held leases whose TTL ran out, by the lessors' clocks."""
        return [action_id for manager in managers if isinstance(manager, Lessor)
                for action_id in manager.expired_leases() if action_id in self._held]

    async def regrant(self, lessor: ResourceManager | None) -> list[Action]:
        """Leases a previous run granted and nobody returned hold their units again until their original expiry:
        their clients still use the units, and a lease forgotten here would hand them to someone else. Those that
        expired meanwhile are recorded as expired; those whose resource is gone, as ``resource_removed``. Returns
        the leases held again."""
        if not isinstance(lessor, Lessor):
            return []
        now = time.time()
        held = []
        for action in await self._store.load_granted_leases(since=now - lessor.longest_lease_s()):
            grant = action.result or {}
            if "returned" in grant or action.id in self._held or action.finished_at is None:
                continue
            expires_at = action.finished_at + float(grant.get("expires_in_s", 0.0))
            allocation = lessor.regrant(action, expires_at - now) if expires_at > now else None
            if allocation is None:
                self.record_return(action, "expired" if expires_at <= now else "resource_removed",
                                   min(expires_at, now))
                continue
            self._held[action.id] = [(lessor, allocation)]
            self._ledger.hold(action)
            held.append(action)
        return held
