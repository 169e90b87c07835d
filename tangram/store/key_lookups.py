"""Idempotency lookups on the submit path: concurrent callers' (task, key) pairs are answered together, one query
per chunk of keys, as concurrent ``durable`` calls share one transaction."""

from __future__ import annotations

import asyncio

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tangram.store.tables import ActionRow

# Keys per idempotency query: tasks and keys stay under SQLite's oldest bound-parameter limit (999).
_LOOKUP_CHUNK = 400
# Built once: constructing a statement costs more than running it on the submit path.
# (task, key) IN (VALUES ...) makes SQLite scan the table; two INs use the unique index, pairs are matched after.
_FIND_KEYS = select(ActionRow.task, ActionRow.idempotency_key, ActionRow.record).where(
    ActionRow.task.in_(bindparam("tasks", expanding=True)),
    ActionRow.idempotency_key.in_(bindparam("keys", expanding=True)))


class KeyLookups:
    """The stored records of (task, idempotency key) pairs, read by one reader task for every caller waiting."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._lookups: list[tuple[list[tuple[str, str]], asyncio.Future[dict[tuple[str, str], str]]]] = []
        self._reader: asyncio.Task[None] | None = None

    async def find(self, wanted: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """The records stored under ``wanted``, by pair; absent pairs have none."""
        future: asyncio.Future[dict[tuple[str, str], str]] = asyncio.get_running_loop().create_future()
        self._lookups.append((wanted, future))
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_keys(), name="tangram-store-reader")
        return await future

    async def close(self) -> None:
        """Wait for the reader to answer the lookups already queued."""
        if self._reader is not None:
            await self._reader

    async def _read_keys(self) -> None:
        """The reader: answer every idempotency lookup queued meanwhile with one query per chunk of keys."""
        while self._lookups:
            lookups, self._lookups = self._lookups, []
            wanted = list({ident for idents, _ in lookups for ident in idents})
            try:
                records: dict[tuple[str, str], str] = {}
                async with self.engine.connect() as conn:
                    for start in range(0, len(wanted), _LOOKUP_CHUNK):
                        chunk = wanted[start:start + _LOOKUP_CHUNK]
                        params = {"tasks": list({task for task, _ in chunk}), "keys": list({key for _, key in chunk})}
                        for found_task, found_key, record in await conn.execute(_FIND_KEYS, params):
                            if found_key is not None:  # matched one of ``keys``: never None (the column allows it)
                                records[(found_task, found_key)] = record
            except Exception as exc:  # noqa: BLE001 - any driver error goes to every waiting lookup
                for _, future in lookups:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for idents, future in lookups:
                if not future.done():
                    future.set_result({ident: records[ident] for ident in idents if ident in records})
        self._reader = None
