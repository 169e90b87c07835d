"""Idempotent submits: a resubmit under a task's idempotency key gets the action it named before, not a new one.

The broker remembers (task, key) -> action id for the actions it holds in memory; keys of actions it has forgotten
(past ``retain_s``) or that a previous run took are found in the store, with one query per submit for all of its
unknown keys (``Store.find_many_by_idempotency``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from tangram.core.action import Action

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
