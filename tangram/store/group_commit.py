"""The store's writes, write-behind: ``save`` only notes the action, and one flusher task writes everything pending in
a single transaction of bulk upserts a few milliseconds later. ``durable`` waits for that commit, so concurrent
submitters share one transaction (group commit) instead of paying one fsync each. A failed write keeps its records
pending and is retried with backoff, so a database that is briefly unavailable loses nothing. A fenced writer
(``fence``) stops writing once deposed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tangram.core.action import Action, State
from tangram.records import stored_record
from tangram.store.fence import Deposed, Fence
from tangram.store.postgres_writer import PostgresWriter
from tangram.store.refusals import refused
from tangram.store.sqlite import sqlite_file
from tangram.store.sqlite_writer import SqliteWriter
from tangram.store.statements import Bulk, dialect_of, upsert
from tangram.store.tables import ActionRow, ProfileRow, SpeedupRow, TransitionRow
from tangram_client.retry import backoff_s

log = logging.getLogger("tangram.store")

# Ids of recently finished actions, so that a late re-save of a terminal action appends no second transition.
_FINISHED_MEMORY = 65_536


#: the ``actions`` columns in the order of ``_serialize``'s tuples (the upsert checks the order it binds them in)
_ACTION_COLUMNS = ("id", "seq", "task", "trajectory", "kind", "state", "idempotency_key", "signature", "submitted_at",
                   "started_at", "finished_at", "record")
_ID = _ACTION_COLUMNS.index("id")


def _transition_time(action: Action) -> float:
    """When the action entered its current state, from its own timestamps when it has them."""
    at: float | None
    if action.state is State.QUEUED:
        at = action.submitted_at
    elif action.state is State.RUNNING:
        at = action.started_at
    else:
        at = action.finished_at
    return time.time() if at is None else at


@dataclass(slots=True)
class _Batch:
    """What one flush writes, taken from the pending buffers in one synchronous step."""

    actions: dict[str, Action] = field(default_factory=dict)
    keys: dict[tuple[str, str], Action] = field(default_factory=dict)  # the keyed ones, by (task, key)
    transitions: list[tuple[str, str, float]] = field(default_factory=list)  # (action id, state, at): a row
    profiles: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)
    speedups: dict[tuple[str, str], str] = field(default_factory=dict)  # runs as JSON
    # (action ids, future): the future completes when those actions' records are committed; no ids for flush().
    waiters: list[tuple[tuple[str, ...], asyncio.Future[None]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.actions or self.transitions or self.profiles or self.speedups or self.waiters)


class GroupCommitWriter:
    """Write-behind, group-committing writes of actions, transitions, duration profiles and speed-up runs.

    A plain ``save`` is written at most ``write_delay_s`` later, together with whatever else arrived meanwhile.
    A failed write is retried, its delay doubling from ``backoff_s`` up to ``max_backoff_s``, for as long as it
    takes; once ``max_attempts`` consecutive attempts have failed, ``durable``/``flush`` callers get the error
    (the records stay pending). ``commits`` counts the write transactions committed, ``failures`` the
    consecutive failed attempts (0 while the database is healthy).
    """

    def __init__(self, engine: AsyncEngine, *, write_delay_s: float = 0.02, max_attempts: int = 3,
                 backoff_s: float = 0.1, max_backoff_s: float = 2.0, fence: Fence | None = None) -> None:
        self.engine = engine
        self._fence = fence
        #: set, with the reason in ``deposed_by``, once the fence refused a write: nothing more is written
        self.deposed = asyncio.Event()
        self.deposed_by: Deposed | None = None
        self.write_delay_s = write_delay_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.commits = 0
        self.failures = 0
        dialect = dialect_of(engine)
        # its rows are ``_serialize``'s tuples as they are
        self._upsert_actions = Bulk(engine, upsert(dialect, ActionRow, ["id"]), list(_ACTION_COLUMNS))
        self._upsert_profiles = Bulk(engine, upsert(dialect, ProfileRow, ["task", "signature"]))
        self._upsert_speedups = Bulk(engine, upsert(dialect, SpeedupRow, ["task", "signature"]))
        # its rows are _Batch.transitions' tuples as they are
        self._insert_transitions = Bulk(engine, dialect.insert(TransitionRow), ["action_id", "state", "at"])
        # commits without the engine's layers: a SQLite file's one thread hop each, PostgreSQL's on asyncpg itself
        # (a fenced store's go through the engine, with the fence)
        self._sqlite = SqliteWriter(database) if fence is None and (database := sqlite_file(engine)) else None
        self._postgres = PostgresWriter(engine) if fence is None and engine.dialect.name == "postgresql" else None
        self._pending = _Batch()
        self._inflight = _Batch()  # the batch being written: no longer pending, not yet readable from the database
        self._states: dict[str, State] = {}  # last saved state of each live action
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()
        self._writing = False
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False

    async def close(self) -> None:
        """Write everything pending and stop the flusher; the engine stays open."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.flush()
        finally:
            pending = self._pending
            lost = len(pending.actions) + len(pending.transitions) + len(pending.profiles) + len(pending.speedups)
            if lost:
                log.error("store closed with %d records unwritten", lost)
            if self._flusher is not None:
                self._flusher.cancel()
                with suppress(asyncio.CancelledError):
                    await self._flusher
            if self._sqlite is not None:
                await self._sqlite.close()
            if self._postgres is not None:
                await self._postgres.close()

    def save(self, action: Action) -> None:
        """Note the action for the next write; its record is serialized then, so the latest snapshot wins."""
        if self._closed:
            raise RuntimeError("store is closed")
        self._pending.actions[action.id] = action
        if action.idempotency_key is not None:
            self._pending.keys[(action.task, action.idempotency_key)] = action
        self._note_state(action)
        self._wake(urgent=False)

    async def durable(self, *actions: Action) -> None:
        """Save and return once the records are committed (raises what rejected the first rejected one, or the last
        write error). One future for all of them, and no task."""
        for action in actions:
            self.save(action)
        await self._wait_for(tuple(action.id for action in actions))

    async def flush(self) -> None:
        """Write everything pending now; returns once committed, including a write already under way."""
        if self._pending or self._writing:
            await self._wait_for(())

    def save_profiles(self, rows: list[tuple[str, str, float, int]]) -> None:
        """Note duration profiles (``DurationModel.take_dirty()`` rows) for the next write."""
        if self._closed:
            raise RuntimeError("store is closed")
        for task, signature, t1, samples in rows:
            self._pending.profiles[(task, signature)] = (t1, samples)
        if rows:
            self._wake(urgent=False)

    def save_speedups(self, rows: list[tuple[str, str, list[list[float]]]]) -> None:
        """Note the runs of speed-up models (``DurationModel.take_dirty_runs()`` rows) for the next write."""
        if self._closed:
            raise RuntimeError("store is closed")
        for task, signature, runs in rows:
            self._pending.speedups[(task, signature)] = orjson.dumps(runs).decode()
        if rows:
            self._wake(urgent=False)

    def _unwritten(self, action_id: str) -> Action | None:
        """The action as saved, while its record is not committed yet (pending or being written)."""
        return self._pending.actions.get(action_id) or self._inflight.actions.get(action_id)

    def _unwritten_by_key(self, ident: tuple[str, str]) -> Action | None:
        """The action saved under (task, idempotency key), while its record is not committed yet."""
        return self._pending.keys.get(ident) or self._inflight.keys.get(ident)

    def _remember_loaded(self, action: Action) -> None:
        """Remember the state of an action read back, so saving it unchanged appends no transition."""
        if action.id not in self._states and action.id not in self._finished:
            if action.state.terminal:
                self._remember_finished(action.id)
            else:
                self._states[action.id] = action.state

    def _note_state(self, action: Action) -> None:
        """Queue a transition row when the action's state differs from the one last saved."""
        state, action_id = action.state, action.id
        if self._states.get(action_id) is state:
            return
        terminal = state.terminal
        if terminal and action_id in self._finished:
            return
        self._pending.transitions.append((action_id, state, _transition_time(action)))
        if terminal:
            self._states.pop(action_id, None)
            self._remember_finished(action_id)
        else:
            self._states[action_id] = state

    def _remember_finished(self, action_id: str) -> None:
        self._finished[action_id] = None
        if len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)

    async def _wait_for(self, action_ids: tuple[str, ...]) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.waiters.append((action_ids, future))
        self._wake(urgent=True)
        await future

    def _wake(self, urgent: bool) -> None:
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._run(), name="tangram-store-flusher")
        self._dirty.set()
        if urgent:
            self._urgent.set()

    async def _run(self) -> None:
        """The flusher: after a save, wait briefly for more (unless someone waits on it), then write them all."""
        while True:
            await self._dirty.wait()
            if not self._urgent.is_set():
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), self.write_delay_s)
            self._dirty.clear()
            self._urgent.clear()
            self._writing = True
            try:
                await self._drain()
            finally:
                self._writing = False

    async def _drain(self) -> None:
        """Write batches until nothing is pending; on failure put the batch back and retry with backoff. A deposed
        store fails its waiters instead: what it holds is no longer its to write."""
        while self._pending:
            batch, self._pending = self._pending, _Batch()
            self._inflight = batch
            try:
                if self.deposed_by is not None:
                    raise self.deposed_by
                rejected = await self._write(batch)
            except Deposed as exc:
                self._inflight = _Batch()
                for _, future in batch.waiters:
                    if not future.done():
                        future.set_exception(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the database is unreachable or failing: nothing is lost
                self._inflight = _Batch()
                self.failures += 1
                log.error("store write of %d actions failed (attempt %d): %r",
                          len(batch.actions), self.failures, exc)
                if self.failures >= self.max_attempts:
                    for _, future in batch.waiters:
                        if not future.done():
                            future.set_exception(exc)
                    batch.waiters.clear()
                self._put_back(batch)
                await asyncio.sleep(backoff_s(self.failures - 1, self.backoff_s, self.max_backoff_s, jitter=False))
                continue
            self._inflight = _Batch()
            self.failures = 0
            for action_ids, future in batch.waiters:
                if not future.done():
                    error = next((rejected[i] for i in action_ids if i in rejected), None) if rejected else None
                    if error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(error)

    def _put_back(self, batch: _Batch) -> None:
        """Return a failed batch to the pending buffers; anything saved meanwhile is newer and wins."""
        pending = self._pending
        for action_id, action in batch.actions.items():
            pending.actions.setdefault(action_id, action)
        for ident, action in batch.keys.items():
            pending.keys.setdefault(ident, action)
        for ident, profile in batch.profiles.items():
            pending.profiles.setdefault(ident, profile)
        for ident, runs in batch.speedups.items():
            pending.speedups.setdefault(ident, runs)
        pending.transitions[:0] = batch.transitions
        pending.waiters[:0] = batch.waiters

    async def _write(self, batch: _Batch) -> dict[str, Exception]:
        """Commit a batch in one transaction; returns the actions rejected for their own data, with why.

        A record the database refuses (e.g. a second action with the same task and idempotency key) would fail
        every retry, so it is isolated row by row, dropped and reported instead of blocking the others. Any other
        error propagates: the whole batch is then retried.
        """
        rows, rejected = self._serialize(batch.actions)
        try:
            await self._commit(rows, batch, rejected)
        except DBAPIError as exc:
            if not refused(exc):
                raise
            for row in rows:
                try:
                    async with self.engine.begin() as conn:
                        await self._fenced(conn)
                        await self._upsert_actions.run(conn, [row])
                except DBAPIError as row_exc:
                    if not refused(row_exc):
                        raise
                    rejected[row[_ID]] = row_exc
            rows = [row for row in rows if row[_ID] not in rejected]
            await self._commit(rows, batch, rejected)
        for action_id, refusal in rejected.items():
            log.error("store rejected action %s: %r", action_id, refusal)
            self._states.pop(action_id, None)
        return rejected

    async def _commit(self, rows: list[tuple[Any, ...]], batch: _Batch, rejected: dict[str, Exception]) -> None:
        transitions = ([row for row in batch.transitions if row[0] not in rejected] if rejected
                       else batch.transitions)
        profiles = [{"task": task, "signature": signature, "t1": t1, "samples": samples}
                    for (task, signature), (t1, samples) in batch.profiles.items()]
        speedups = [{"task": task, "signature": signature, "runs": runs}
                    for (task, signature), runs in batch.speedups.items()]
        written = [(bulk, params) for bulk, params in (
            (self._upsert_actions, rows), (self._insert_transitions, transitions),
            (self._upsert_profiles, self._upsert_profiles.params(profiles)),
            (self._upsert_speedups, self._upsert_speedups.params(speedups))) if params]
        if not written:
            return
        if self._sqlite is not None:
            await self._sqlite.commit([statement for bulk, params in written for statement in bulk.in_groups(params)])
            self.commits += 1
            return
        if self._postgres is not None:
            await self._postgres.commit([(bulk.sql, params) for bulk, params in written])
            self.commits += 1
            return
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            for bulk, params in written:
                await bulk.run(conn, params)
        self.commits += 1

    async def _fenced(self, conn: AsyncConnection) -> None:
        """Run the fence in the write transaction ``conn``; the first refusal deposes the store."""
        if self._fence is None:
            return
        try:
            await self._fence(conn)
        except Deposed as exc:
            if self.deposed_by is None:
                log.critical("store writes refused: %s", exc)
                self.deposed_by = exc
                self.deposed.set()
            raise

    @staticmethod
    def _serialize(actions: dict[str, Action]) -> tuple[list[tuple[Any, ...]], dict[str, Exception]]:
        """The actions' rows (``_ACTION_COLUMNS``; ``kind`` and ``state`` as ``StrEnum`` members, which both drivers
        bind as their text) and those whose record is not JSON."""
        rows: list[tuple[Any, ...]] = []
        rejected: dict[str, Exception] = {}
        for action in actions.values():
            try:
                record = stored_record(action)
            except (TypeError, orjson.JSONEncodeError) as exc:  # e.g. a result that is not JSON
                rejected[action.id] = exc
                continue
            rows.append((action.id, action.seq, action.task, action.trajectory, action.kind, action.state,
                         action.idempotency_key, action.signature, action.submitted_at, action.started_at,
                         action.finished_at, record))
        return rows, rejected
