"""Persistence of the broker: action records, their state transitions, learned duration profiles, the runs of
learned speed-up models, API tokens and the SLO plans made through the API.

Writes are write-behind: ``save`` only notes the action, and one flusher task writes everything pending in a
single transaction of bulk upserts a few milliseconds later. ``durable`` waits for that commit, so concurrent
submitters share one transaction (group commit) instead of paying one fsync each. A failed write keeps its
records pending and is retried with backoff, so a database that is briefly unavailable loses nothing.

SQLite (``sqlite+aiosqlite:///path``) by default, PostgreSQL (``postgresql+asyncpg://...``) in production.

A store may be fenced (``fence``): a check run first in every write transaction, which raises ``Deposed`` once
another broker leads the database (``tangram/leadership.py``). A deposed store writes nothing more, so an old
leader that has not yet noticed its loss cannot overwrite what the new one recovered.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import (
    BigInteger,
    Double,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    bindparam,
    delete,
    event,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import StaticPool

from tangram.core.action import Action, State
from tangram.core.retry import backoff_s
from tangram.records import action_from_stored, stored_record

log = logging.getLogger(__name__)

# Ids of recently finished actions, so that a late re-save of a terminal action appends no second transition.
_FINISHED_MEMORY = 65_536
_UNFINISHED = (State.QUEUED.value, State.RUNNING.value)
# 64-bit ids and counters (a busy broker passes 2**31 transitions in days); SQLite autoincrements INTEGER only.
_BIG = BigInteger().with_variant(Integer, "sqlite")
# Keys per idempotency query: tasks and keys stay under SQLite's oldest bound-parameter limit (999).
_LOOKUP_CHUNK = 400


class Deposed(Exception):
    """The fence refused a write: another broker leads this store now."""


#: run first in each write transaction; raises ``Deposed`` when this broker no longer leads
Fence = Callable[[AsyncConnection], Awaitable[None]]


class Base(DeclarativeBase):
    """Metadata of the broker's tables; other persistent state can declare its tables on it too."""


def _create_missing_indexes(conn: Any) -> None:
    """``create_all`` makes indexes only with their table: a database from an older version gets new ones here."""
    for table in Base.metadata.sorted_tables:
        for index in table.indexes:
            index.create(conn, checkfirst=True)


class ActionRow(Base):
    __tablename__ = "actions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    seq: Mapped[int] = mapped_column(_BIG)
    task: Mapped[str] = mapped_column(String)
    trajectory: Mapped[str | None] = mapped_column(String)
    kind: Mapped[str] = mapped_column(String)
    state: Mapped[str] = mapped_column(String, index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String)
    signature: Mapped[str] = mapped_column(String)
    submitted_at: Mapped[float] = mapped_column(Double)
    started_at: Mapped[float | None] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double)
    record: Mapped[str] = mapped_column(Text)

    # NULL keys never collide (NULLs are distinct on both databases), so only keyed actions are constrained.
    __table_args__ = (UniqueConstraint("task", "idempotency_key", name="uq_actions_task_idempotency_key"),
                      # a restart's search for leases still held (``load_granted_leases``)
                      Index("ix_actions_kind_state_finished_at", "kind", "state", "finished_at"))


class TransitionRow(Base):
    __tablename__ = "transitions"

    id: Mapped[int] = mapped_column(_BIG, primary_key=True, autoincrement=True)
    action_id: Mapped[str] = mapped_column(String)
    state: Mapped[str] = mapped_column(String)
    at: Mapped[float] = mapped_column(Double)

    __table_args__ = (Index("ix_transitions_action_id", "action_id", "id"),)


class ProfileRow(Base):
    __tablename__ = "profiles"

    task: Mapped[str] = mapped_column(String, primary_key=True)
    signature: Mapped[str] = mapped_column(String, primary_key=True)
    t1: Mapped[float] = mapped_column(Double)
    samples: Mapped[int] = mapped_column(_BIG)


class SpeedupRow(Base):
    """The runs a (task, signature)'s speed-up model is fitted to (``tangram.sched.speedup``), as a JSON list."""

    __tablename__ = "speedups"

    task: Mapped[str] = mapped_column(String, primary_key=True)
    signature: Mapped[str] = mapped_column(String, primary_key=True)
    runs: Mapped[str] = mapped_column(Text)


class TokenRow(Base):
    """An API token made by ``tangram token create`` or ``POST /v1/admin/tokens``: only its SHA-256 is kept."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    task: Mapped[str | None] = mapped_column(String)  # None: an admin token
    note: Mapped[str] = mapped_column(String)
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double)


class SloPlanRow(Base):
    """A task's SLO plan made by ``PUT /v1/tasks/NAME/slo`` (``tangram.slo.plan.SloPlan``'s fields as JSON)."""

    __tablename__ = "slo_plans"

    task: Mapped[str] = mapped_column(String, primary_key=True)
    plan: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[float] = mapped_column(Double)


@dataclass(frozen=True, slots=True)
class StoredToken:
    """A token row; ``task`` None is the admin."""

    id: str
    sha256: str
    task: str | None
    note: str
    created_at: float
    revoked_at: float | None = None


# Built once: constructing a statement costs more than running it on the submit path.
_GET = select(ActionRow.record).where(ActionRow.id == bindparam("id"))
# (task, key) IN (VALUES ...) makes SQLite scan the table; two INs use the unique index, pairs are matched after.
_FIND_KEYS = select(ActionRow.task, ActionRow.idempotency_key, ActionRow.record).where(
    ActionRow.task.in_(bindparam("tasks", expanding=True)),
    ActionRow.idempotency_key.in_(bindparam("keys", expanding=True)))


def _snapshot(action: Action) -> Action:
    """A copy of an action whose record is not committed yet, as a database read would return it."""
    return action_from_stored(stored_record(action))


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
    transitions: list[tuple[str, str, float]] = field(default_factory=list)
    profiles: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)
    speedups: dict[tuple[str, str], str] = field(default_factory=dict)  # runs as JSON
    # (action id, future): the future completes when that action's record is committed; id None for flush().
    waiters: list[tuple[str | None, asyncio.Future[None]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.actions or self.transitions or self.profiles or self.speedups or self.waiters)


def _create_private(database: str) -> None:
    """Create the SQLite file 0600 before SQLite does (its default is 0644 less the umask): it holds every action's
    spec and result and the tokens' hashes. SQLite gives its journal and WAL files the database file's mode. An
    existing file keeps its mode."""
    try:
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        pass


class Store:
    """Write-behind, group-committing persistence of actions, transitions and duration profiles.

    Reads see every earlier ``save``: ``get`` and ``find_by_idempotency`` look at the records not yet committed
    first (they are on the submit path and must not wait for a write), the other reads flush first. Concurrent
    idempotency lookups share one query, as concurrent ``durable`` calls share one transaction.

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
        dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
        self._upsert_actions = _Bulk(engine, _upsert(dialect, ActionRow, ["id"]))
        self._upsert_profiles = _Bulk(engine, _upsert(dialect, ProfileRow, ["task", "signature"]))
        self._upsert_speedups = _Bulk(engine, _upsert(dialect, SpeedupRow, ["task", "signature"]))
        self._insert_transitions = _Bulk(engine, dialect.insert(TransitionRow), ["action_id", "state", "at"])
        self._pending = _Batch()
        self._inflight = _Batch()  # the batch being written: no longer pending, not yet readable from the database
        self._lookups: list[tuple[list[tuple[str, str]], asyncio.Future[dict[tuple[str, str], str]]]] = []
        self._reader: asyncio.Task[None] | None = None
        self._states: dict[str, State] = {}  # last saved state of each live action
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()
        self._writing = False
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def open(cls, url: str, **settings: Any) -> Store:
        """Create the engine and the tables; ``settings`` are the constructor's keyword arguments."""
        parsed = make_url(url)
        backend = parsed.get_backend_name()
        options: dict[str, Any] = {}
        if backend == "sqlite":
            database = parsed.database or ""
            if database in ("", ":memory:"):
                options["poolclass"] = StaticPool  # every connection would otherwise see its own empty database
            elif not database.startswith("file:"):
                Path(database).parent.mkdir(parents=True, exist_ok=True)
                _create_private(database)
        elif backend != "postgresql":
            raise ValueError(f"unsupported database {backend!r}: use sqlite+aiosqlite or postgresql+asyncpg")
        engine = create_async_engine(parsed, **options)
        if backend == "sqlite":
            event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
            await conn.run_sync(_create_missing_indexes)
        return cls(engine, **settings)

    async def close(self) -> None:
        """Write everything pending, stop the flusher and release the connections."""
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
            if self._reader is not None:
                await self._reader
            await self.engine.dispose()

    # -- writes -------------------------------------------------------------------------------------------------

    def save(self, action: Action) -> None:
        """Note the action for the next write; its record is serialized then, so the latest snapshot wins."""
        if self._closed:
            raise RuntimeError("store is closed")
        self._pending.actions[action.id] = action
        if action.idempotency_key is not None:
            self._pending.keys[(action.task, action.idempotency_key)] = action
        self._note_state(action)
        self._wake(urgent=False)

    async def durable(self, action: Action) -> None:
        """Save and return once the record is committed (raises what rejected it, or the last write error)."""
        self.save(action)
        await self._wait_for(action.id)

    async def flush(self) -> None:
        """Write everything pending now; returns once committed, including a write already under way."""
        if self._pending or self._writing:
            await self._wait_for(None)

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

    def _note_state(self, action: Action) -> None:
        """Queue a transition row when the action's state differs from the one last saved."""
        state = action.state
        if self._states.get(action.id) == state or (state.terminal and action.id in self._finished):
            return
        self._pending.transitions.append((action.id, state.value, _transition_time(action)))
        if state.terminal:
            self._states.pop(action.id, None)
            self._remember_finished(action.id)
        else:
            self._states[action.id] = state

    def _remember_finished(self, action_id: str) -> None:
        self._finished[action_id] = None
        if len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)

    async def _wait_for(self, action_id: str | None) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.waiters.append((action_id, future))
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
            for action_id, future in batch.waiters:
                if not future.done():
                    error = rejected.get(action_id) if action_id is not None else None
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
            if not _refused(exc):
                raise
            for row in rows:
                try:
                    async with self.engine.begin() as conn:
                        await self._fenced(conn)
                        await self._upsert_actions.run(conn, [row])
                except DBAPIError as row_exc:
                    if not _refused(row_exc):
                        raise
                    rejected[row["id"]] = row_exc
            rows = [row for row in rows if row["id"] not in rejected]
            await self._commit(rows, batch, rejected)
        for action_id, refusal in rejected.items():
            log.error("store rejected action %s: %r", action_id, refusal)
            self._states.pop(action_id, None)
        return rejected

    async def _commit(self, rows: list[dict[str, Any]], batch: _Batch, rejected: dict[str, Exception]) -> None:
        transitions = [{"action_id": action_id, "state": state, "at": at}
                       for action_id, state, at in batch.transitions if action_id not in rejected]
        profiles = [{"task": task, "signature": signature, "t1": t1, "samples": samples}
                    for (task, signature), (t1, samples) in batch.profiles.items()]
        speedups = [{"task": task, "signature": signature, "runs": runs}
                    for (task, signature), runs in batch.speedups.items()]
        if not (rows or transitions or profiles or speedups):
            return
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            if rows:
                await self._upsert_actions.run(conn, rows)
            if transitions:
                await self._insert_transitions.run(conn, transitions)
            if profiles:
                await self._upsert_profiles.run(conn, profiles)
            if speedups:
                await self._upsert_speedups.run(conn, speedups)
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
    def _serialize(actions: dict[str, Action]) -> tuple[list[dict[str, Any]], dict[str, Exception]]:
        rows: list[dict[str, Any]] = []
        rejected: dict[str, Exception] = {}
        for action in actions.values():
            try:
                record = stored_record(action)
            except (TypeError, orjson.JSONEncodeError) as exc:  # e.g. a result that is not JSON
                rejected[action.id] = exc
                continue
            rows.append({"id": action.id, "seq": action.seq, "task": action.task,
                         "trajectory": action.trajectory, "kind": action.kind.value,
                         "state": action.state.value, "idempotency_key": action.idempotency_key,
                         "signature": action.signature, "submitted_at": action.submitted_at,
                         "started_at": action.started_at, "finished_at": action.finished_at,
                         "record": record})
        return rows, rejected

    # -- reads --------------------------------------------------------------------------------------------------

    async def get(self, action_id: str) -> Action | None:
        unwritten = self._pending.actions.get(action_id) or self._inflight.actions.get(action_id)
        if unwritten is not None:
            return _snapshot(unwritten)
        async with self.engine.connect() as conn:
            record = await conn.scalar(_GET, {"id": action_id})
        return None if record is None else self._loaded(record)

    async def find_by_idempotency(self, task: str, key: str) -> Action | None:
        return (await self.find_many_by_idempotency([(task, key)])).get((task, key))

    async def find_many_by_idempotency(self, idents: list[tuple[str, str]]) -> dict[tuple[str, str], Action]:
        """The actions already submitted under these (task, idempotency key) pairs; absent pairs are new.

        One query answers a whole batch submit, and concurrent callers' lookups are merged into it.
        """
        found: dict[tuple[str, str], Action] = {}
        wanted: list[tuple[str, str]] = []
        for ident in idents:
            unwritten = self._pending.keys.get(ident) or self._inflight.keys.get(ident)
            if unwritten is None:
                wanted.append(ident)
            else:
                found[ident] = _snapshot(unwritten)
        if wanted:
            future: asyncio.Future[dict[tuple[str, str], str]] = asyncio.get_running_loop().create_future()
            self._lookups.append((wanted, future))
            if self._reader is None:
                self._reader = asyncio.get_running_loop().create_task(self._read_keys(), name="tangram-store-reader")
            for ident, record in (await future).items():
                found[ident] = self._loaded(record)
        return found

    async def load_unfinished(self) -> list[Action]:
        """Queued and running actions in submission order, to resume after a restart."""
        return await self._load(select(ActionRow.record).where(ActionRow.state.in_(_UNFINISHED))
                                .order_by(ActionRow.seq))

    async def load_granted_leases(self, since: float) -> list[Action]:
        """Lease actions granted (succeeded) at ``since`` or later, returned or not: the caller reads their result."""
        return await self._load(select(ActionRow.record).where(
            ActionRow.kind == "lease", ActionRow.state == State.SUCCEEDED.value, ActionRow.finished_at >= since)
            .order_by(ActionRow.seq))

    async def max_seq(self) -> int:
        await self.flush()
        async with self.engine.connect() as conn:
            return (await conn.scalar(select(func.max(ActionRow.seq)))) or 0

    async def transitions(self, action_id: str) -> list[tuple[str, float]]:
        await self.flush()
        query = (select(TransitionRow.state, TransitionRow.at).where(TransitionRow.action_id == action_id)
                 .order_by(TransitionRow.id))
        async with self.engine.connect() as conn:
            return [(state, at) for state, at in await conn.execute(query)]

    async def load_profiles(self) -> list[tuple[str, str, float, int]]:
        await self.flush()
        query = select(ProfileRow.task, ProfileRow.signature, ProfileRow.t1, ProfileRow.samples)
        async with self.engine.connect() as conn:
            return [(task, signature, t1, samples) for task, signature, t1, samples in await conn.execute(query)]

    async def load_speedups(self) -> list[tuple[str, str, list[list[float]]]]:
        await self.flush()
        query = select(SpeedupRow.task, SpeedupRow.signature, SpeedupRow.runs)
        async with self.engine.connect() as conn:
            return [(task, signature, orjson.loads(runs)) for task, signature, runs in await conn.execute(query)]

    # -- tokens: rare writes, committed at once (not write-behind) ------------------------------------------------

    async def add_token(self, token: StoredToken) -> None:
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            await conn.execute(insert(TokenRow).values(
                id=token.id, sha256=token.sha256, task=token.task, note=token.note, created_at=token.created_at,
                revoked_at=token.revoked_at))

    async def revoke_token(self, token_id: str, at: float) -> StoredToken | None:
        """Mark the token revoked at ``at`` (kept if it already was); None if there is no such token."""
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            await conn.execute(update(TokenRow).where(TokenRow.id == token_id, TokenRow.revoked_at.is_(None))
                               .values(revoked_at=at))
            row = (await conn.execute(select(TokenRow).where(TokenRow.id == token_id))).first()
        return None if row is None else _stored_token(row)

    async def load_tokens(self) -> list[StoredToken]:
        """Every token, revoked ones included, oldest first."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(TokenRow).order_by(TokenRow.created_at, TokenRow.id))
            return [_stored_token(row) for row in rows]

    # -- SLO plans: rare writes, committed at once ---------------------------------------------------------------

    async def put_slo_plan(self, task: str, plan: dict[str, Any], at: float) -> None:
        """Keep ``task``'s plan (its fields), replacing the one it had."""
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            await conn.execute(_upsert(dialect, SloPlanRow, ["task"]).values(
                task=task, plan=orjson.dumps(plan).decode(), updated_at=at))

    async def delete_slo_plan(self, task: str) -> bool:
        """Forget ``task``'s plan; False if it had none."""
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            deleted = await conn.execute(delete(SloPlanRow).where(SloPlanRow.task == task))
        return bool(deleted.rowcount)

    async def load_slo_plans(self) -> dict[str, dict[str, Any]]:
        """Every task's plan (its fields), oldest first."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(SloPlanRow.task, SloPlanRow.plan).order_by(SloPlanRow.updated_at))
            return {task: orjson.loads(plan) for task, plan in rows}

    async def _load(self, query: Any) -> list[Action]:
        await self.flush()
        async with self.engine.connect() as conn:
            records = (await conn.scalars(query)).all()
        return [self._loaded(record) for record in records]

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

    def _loaded(self, record: str) -> Action:
        """Rebuild a stored action and remember its state, so saving it unchanged appends no transition."""
        action = action_from_stored(record)
        if action.id not in self._states and action.id not in self._finished:
            if action.state.terminal:
                self._remember_finished(action.id)
            else:
                self._states[action.id] = action.state
        return action


class _Bulk:
    """A statement compiled once for the engine's dialect and run through the driver's executemany.

    Core's executemany processes every parameter set in Python, about a third of the CPU a written row costs
    here; our column types need no bind processing, so rows go to the driver as plain tuples.
    """

    def __init__(self, engine: AsyncEngine, statement: Any, keys: list[str] | None = None) -> None:
        compiled = statement.compile(dialect=engine.dialect, column_keys=keys, for_executemany=True)
        self.sql = compiled.string
        self.values = operator.itemgetter(*compiled.positiontup)

    async def run(self, conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
        await conn.exec_driver_sql(self.sql, [self.values(row) for row in rows])


def _stored_token(row: Any) -> StoredToken:
    return StoredToken(id=row.id, sha256=row.sha256, task=row.task, note=row.note, created_at=row.created_at,
                       revoked_at=row.revoked_at)


def _refused(exc: DBAPIError) -> bool:
    """Whether the database refused the data itself (a constraint, a bad value), so no retry can succeed.

    asyncpg reports most server errors as a generic DBAPIError; its SQLSTATE class tells data (22) and
    integrity (23) errors apart from a server that is down, restarting or overloaded.
    """
    if isinstance(exc, (IntegrityError, DataError)):
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None) or ""
    return sqlstate[:2] in ("22", "23")


def _upsert(dialect: Any, table: type[Base], keys: list[str]) -> Any:
    """INSERT ... ON CONFLICT (keys) DO UPDATE of every other column, executed with many parameter sets."""
    statement = dialect.insert(table)
    columns = [column.name for column in table.__table__.columns if column.name not in keys]
    return statement.on_conflict_do_update(index_elements=keys,
                                           set_={name: statement.excluded[name] for name in columns})


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL lets readers run beside the flusher; NORMAL skips the fsync per commit (WAL stays consistent)."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
