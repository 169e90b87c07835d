"""Idempotent submits: a resubmit under a task's idempotency key gets the action it named before, not a new one.

The broker remembers (task, key) -> action id for the actions it holds in memory; keys of actions it has forgotten
(past ``retain_s``) or that a previous run took are found in the store, with one query per submit for all of its
unknown keys (``Store.find_many_by_idempotency``).

A key names one request: a resubmit that asks for something else under it is a 409, never the earlier action's
record (the client would take that answer for its new request's). What is compared is the request as the action
holds it (kind, trajectory, demand, elasticity, spec, deadline, signature), which the stored record keeps whole,
so no digest needs storing: a demand written as a range or as the list of its counts is the same request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tangram.core.action import Action
from tangram.core.errors import Conflict

Ident = tuple[str, str]


class KeyLookup(Protocol):
    async def find_many_by_idempotency(self, idents: list[Ident]) -> dict[Ident, Action]: ...


class IdempotencyIndex:
    """(task, idempotency key) -> the id of the action submitted under it, for the actions in memory."""

    def __init__(self) -> None:
        self._ids: dict[Ident, str] = {}

    def __contains__(self, ident: object) -> bool:
        return ident in self._ids

    def remember(self, action: Action) -> None:
        if action.idempotency_key is not None:
            self._ids[(action.task, action.idempotency_key)] = action.id

    def forget(self, action: Action) -> None:
        """The action leaves memory; its key is then answered from the store."""
        if action.idempotency_key is not None:
            self._ids.pop((action.task, action.idempotency_key), None)

    async def stored(self, actions: Sequence[Action], store: KeyLookup) -> dict[Ident, Action]:
        """Earlier actions under these actions' keys that memory does not hold: one query for them all."""
        unknown = [(a.task, a.idempotency_key) for a in actions
                   if a.idempotency_key is not None and (a.task, a.idempotency_key) not in self._ids]
        return await store.find_many_by_idempotency(unknown) if unknown else {}

    def existing(self, action: Action, stored: Mapping[Ident, Action],
                 in_memory: Mapping[str, Action]) -> Action | None:
        """The action submitted earlier under ``action``'s key, from memory or from ``stored``; None if none was."""
        if action.idempotency_key is None:
            return None
        ident = (action.task, action.idempotency_key)
        known = self._ids.get(ident)
        if known is not None and known in in_memory:
            return in_memory[known]
        return stored.get(ident)

    def check_replays(self, actions: Sequence[Action], stored: Mapping[Ident, Action],
                      in_memory: Mapping[str, Action]) -> list[Action | None]:
        """The action each of ``actions`` replays (``existing``; None for a new one), or 409 (``Conflict`` on
        ``idempotency_key``) if any reuses a key, earlier or within this submit, for a different request; nothing
        is queued then."""
        first: dict[Ident, Action] = {}
        replayed = [self.existing(action, stored, in_memory) for action in actions]
        for index, (action, existing) in enumerate(zip(actions, replayed, strict=True)):
            if action.idempotency_key is None:
                continue
            ident = (action.task, action.idempotency_key)
            earlier = existing or first.setdefault(ident, action)
            asked = request_of(earlier)
            differs = [name for name, value in request_of(action).items() if asked[name] != value]
            if differs:
                where = f"actions[{index}]." if len(actions) > 1 else ""
                holder = f"action {existing.id}" if existing is not None else "an earlier action of this batch"
                raise Conflict(f"{where}idempotency_key",
                               f"was used for another request of task {action.task!r} ({holder}, which differs in "
                               f"{', '.join(differs)}); a key names one request: send a new key for a new one",
                               action=None if existing is None else existing.id)
        return replayed


def request_of(action: Action) -> dict[str, Any]:
    """What a client asked for in ``action``, field by field (the task and the key name it)."""
    return {"kind": action.kind, "trajectory": action.trajectory, "demand": action.demands,
            "elasticity": action.elasticity, "spec": action.spec, "timeout_s": action.timeout_s,
            "signature": action.signature}
