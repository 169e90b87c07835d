"""The store against real SQLite and real PostgreSQL (see the ``store`` fixture in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, inspect, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import create_async_engine

from tangram.core.action import Action, Demand, State
from tangram.core.errors import ConfigError
from tangram.parse import parse_action
from tangram.records import action_from_stored, stored_record
from tangram.store.postgres_writer import PostgresWriter
from tangram.store.sqlite_writer import SqliteWriter
from tangram.store.statements import ROW_GROUPS
from tangram.store.store import Store
from tangram.store.tables import ActionRow, TransitionRow

FIELDS = [f.name for f in dataclasses.fields(Action)]


def make_action(seq: int = 1, task: str = "math", **body: Any) -> Action:
    action = parse_action({"task": task, "kind": "exec", "demand": {"cpu": 1}, **body})
    action.seq = seq
    return action


def rich_action() -> Action:
    action = parse_action({
        "task": "swe-bench", "trajectory": "traj-17", "kind": "exec",
        "demand": {"cpu": {"min": 1, "max": 8}, "gpu": {"choices": [1, 2, 4]}, "memory_mb": 2048},
        "elasticity": {"resource": "cpu", "efficiency": {"1": 1.0, "4": 0.85, "8": 0.6}, "t1": 12.5},
        "spec": {"command": ["pytest", "-x"], "env": {"A": "1"}, "nested": [{"x": None, "y": 1.25}]},
        "timeout_s": 120.5, "idempotency_key": "key-1", "signature": "exec|pytest",
    })
    action.seq = 42
    action.state = State.FAILED
    action.submitted_at = 1_700_000_000.125
    action.started_at = 1_700_000_001.5
    action.finished_at = 1_700_000_009.75
    action.execution_s = 8.0625
    action.units = {"cpu": 4, "gpu": 2, "memory_mb": 2048}
    action.placement = {"node": "node-3", "cores": [4, 5, 6, 7], "gpus": {"chunk": [0, 1]}}
    action.result = {"exit_code": 1, "stdout": "FAILED test_x\n", "ratio": 0.1 + 0.2}
    action.error = {"code": "exec_error", "message": "exit status 1", "exit_code": 1}
    action.expected_duration_s = 3.3
    return action


def assert_same(got: Action | None, want: Action) -> None:
    assert got is not None
    for name in FIELDS:
        assert getattr(got, name) == getattr(want, name), name


def present(got: Action | None) -> Action:
    """A record the store must have found."""
    assert got is not None
    return got


def idempotency_of(action: Action) -> tuple[str, str]:
    """The (task, idempotency key) an action was saved under; it must have a key."""
    assert action.idempotency_key is not None
    return action.task, action.idempotency_key


async def count(store: Store, table: Any) -> int:
    async with store.engine.connect() as conn:
        total = await conn.scalar(select(func.count()).select_from(table))
    assert total is not None
    return total


@pytest.mark.parametrize("build", [rich_action, make_action], ids=["rich", "minimal"])
async def test_round_trip_restores_every_field(store: Store, build) -> None:
    action = build()
    store.save(action)
    await store.flush()
    got = await store.get(action.id)
    assert got is not action
    assert_same(got, action)
    assert await store.get("act_missing") is None


async def test_reads_see_saves_not_yet_written(store_url: str, store: Store) -> None:
    lazy = await Store.open(store_url, write_delay_s=60)
    try:
        action = make_action(idempotency_key="k1")
        lazy.save(action)
        got = present(await lazy.get(action.id))
        assert got is not action
        assert_same(got, action)
        assert_same(await lazy.find_by_idempotency("math", "k1"), action)
        assert lazy.commits == 0
        got.spec["mutated"] = True  # a copy, as a database read returns
        assert "mutated" not in action.spec
    finally:
        await lazy.close()


@contextlib.asynccontextmanager
async def write_lock(url: str) -> AsyncIterator[None]:
    """Another client holding the write lock on the actions table: our writes wait, reads still run."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        assert parsed.database is not None
        other = sqlite3.connect(parsed.database, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            other.execute("ROLLBACK")
            other.close()
        return
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.exec_driver_sql("LOCK TABLE actions IN EXCLUSIVE MODE")
            yield
    finally:
        await engine.dispose()


async def test_reads_see_a_record_while_it_is_being_written(store_url: str, store: Store) -> None:
    await store.durable(make_action())  # the write path is warm: the next write blocks on the lock, not earlier
    action = make_action(idempotency_key="k1")
    async with write_lock(store_url):
        writing = asyncio.create_task(store.durable(action))
        await asyncio.sleep(0.2)
        assert not writing.done()
        assert_same(await store.get(action.id), action)
        assert_same(await store.find_by_idempotency("math", "k1"), action)
    await writing
    async with store.engine.connect() as conn:
        assert await conn.scalar(select(ActionRow.id).where(ActionRow.id == action.id)) == action.id


async def test_find_many_by_idempotency(store: Store) -> None:
    actions = [make_action(seq=i, task=f"t{i % 3}", idempotency_key=f"k{i}") for i in range(1000)]
    for action in actions:
        store.save(action)
    await store.flush()
    wanted = [idempotency_of(a) for a in actions[::2]] + [("t0", "k1"), ("t9", "k0")]  # last two: absent
    found = await store.find_many_by_idempotency(wanted)
    assert sorted(found) == sorted(wanted[:-2])
    for action in actions[::2]:
        assert_same(found[idempotency_of(action)], action)


async def test_concurrent_idempotency_lookups_share_queries(store: Store) -> None:
    actions = [make_action(seq=i, idempotency_key=f"k{i}") for i in range(300)]
    for action in actions:
        store.save(action)
    await store.flush()
    selects = 0

    def count_selects(conn, cursor, statement: str, *args: Any) -> None:
        nonlocal selects
        selects += statement.lstrip().upper().startswith("SELECT")

    event.listen(store.engine.sync_engine, "before_cursor_execute", count_selects)
    try:
        found = await asyncio.gather(*(store.find_by_idempotency("math", f"k{i}") for i in range(600)))
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", count_selects)
    assert [a.id if a is not None else None for a in found[:300]] == [a.id for a in actions]
    assert found[300:] == [None] * 300
    assert 1 <= selects <= 5, selects


async def test_find_by_idempotency_key(store: Store) -> None:
    keyed = make_action(idempotency_key="k1")
    other_task = make_action(task="code", idempotency_key="k1")
    unkeyed = [make_action(), make_action()]  # no key: never collide with each other
    for action in (keyed, other_task, *unkeyed):
        await store.durable(action)
    assert present(await store.find_by_idempotency("math", "k1")).id == keyed.id
    assert present(await store.find_by_idempotency("code", "k1")).id == other_task.id
    assert await store.find_by_idempotency("math", "k2") is None
    assert await count(store, ActionRow) == 4


async def test_same_task_and_key_is_rejected_and_store_stays_usable(store: Store) -> None:
    first = make_action(idempotency_key="k1")
    await store.durable(first)
    duplicate = make_action(idempotency_key="k1")
    with pytest.raises(IntegrityError):
        await store.durable(duplicate)
    assert await store.get(duplicate.id) is None
    assert await store.transitions(duplicate.id) == []
    assert present(await store.find_by_idempotency("math", "k1")).id == first.id
    later = make_action(idempotency_key="k2")
    await store.durable(later)
    assert_same(await store.get(later.id), later)
    assert store.failures == 0


async def test_conflict_inside_one_batch_rejects_only_the_duplicate(store: Store) -> None:
    first, duplicate = make_action(idempotency_key="k1"), make_action(idempotency_key="k1")
    bystanders = [make_action(seq=i) for i in range(10)]
    results = await asyncio.gather(*(store.durable(a) for a in (first, duplicate, *bystanders)),
                                   return_exceptions=True)
    assert results[0] is None and isinstance(results[1], IntegrityError)
    assert results[2:] == [None] * len(bystanders)
    assert await store.get(duplicate.id) is None
    for action in (first, *bystanders):
        assert_same(await store.get(action.id), action)
        assert await store.transitions(action.id) == [("queued", action.submitted_at)]


async def test_one_durable_call_of_many_actions_writes_all_but_the_refused_one_and_raises_its_refusal(
        store: Store) -> None:
    """As many actions as the SQLite writer's statement sizes add up to (511: one statement of each size), one of
    them refused for a key an earlier action of the call took."""
    actions = [make_action(seq=i, idempotency_key=f"k{i}") for i in range(sum(ROW_GROUPS))]
    actions[150].idempotency_key = "k7"
    with pytest.raises(IntegrityError):
        await store.durable(*actions)
    assert await store.get(actions[150].id) is None
    kept = actions[:150] + actions[151:]
    assert [a.seq for a in await store.load_unfinished()] == [a.seq for a in kept]
    for action in kept[::7]:
        assert_same(await store.get(action.id), action)
    assert await count(store, TransitionRow) == len(kept)


async def test_unserializable_record_rejects_only_that_action(store: Store) -> None:
    bad, good = make_action(), make_action()
    bad.result = object()
    results = await asyncio.gather(store.durable(bad), store.durable(good), return_exceptions=True)
    assert isinstance(results[0], TypeError) and results[1] is None
    assert await store.get(bad.id) is None
    assert_same(await store.get(good.id), good)


async def test_value_refused_by_database_rejects_only_that_action(store: Store) -> None:
    odd, good = make_action(), make_action()
    odd.idempotency_key = "a\x00b"  # parse_action refuses NUL now; the store must still isolate such a row
    results = await asyncio.gather(store.durable(odd), store.durable(good), return_exceptions=True)
    assert results[1] is None and store.failures == 0
    assert_same(await store.get(good.id), good)
    if store.engine.dialect.name == "postgresql":  # text cannot hold NUL there; SQLite stores it
        assert isinstance(results[0], DBAPIError)
        assert await store.get(odd.id) is None
    else:
        assert results[0] is None


async def test_transitions_appended_once_per_state_change(store: Store) -> None:
    action = make_action()
    store.save(action)
    store.save(action)
    await store.flush()
    action.state, action.started_at = State.RUNNING, action.submitted_at + 1.5
    await store.durable(action)
    await store.durable(action)
    action.state, action.finished_at = State.SUCCEEDED, action.submitted_at + 4.0
    await store.durable(action)
    action.result = {"late": "update"}
    await store.durable(action)
    assert await store.transitions(action.id) == [
        ("queued", action.submitted_at), ("running", action.started_at), ("succeeded", action.finished_at)]
    assert present(await store.get(action.id)).result == {"late": "update"}


async def test_state_changes_between_writes_each_get_a_transition(store: Store) -> None:
    action = make_action()
    store.save(action)
    action.state, action.started_at = State.RUNNING, action.submitted_at + 1
    store.save(action)
    action.state, action.finished_at = State.TIMED_OUT, action.submitted_at + 2
    store.save(action)
    await store.flush()
    assert [state for state, _ in await store.transitions(action.id)] == ["queued", "running", "timed_out"]
    assert present(await store.get(action.id)).state is State.TIMED_OUT


async def test_load_unfinished_in_seq_order_and_max_seq(store: Store) -> None:
    assert await store.max_seq() == 0
    assert await store.load_unfinished() == []
    states = {5: State.QUEUED, 2: State.RUNNING, 9: State.SUCCEEDED, 1: State.QUEUED, 7: State.CANCELLED,
              3: State.FAILED, 4: State.RUNNING}
    actions = {}
    for seq, state in states.items():
        actions[seq] = make_action(seq=seq)
        actions[seq].state = state
        store.save(actions[seq])
    unfinished = await store.load_unfinished()
    assert [a.seq for a in unfinished] == [1, 2, 4, 5]
    for got in unfinished:
        assert_same(got, actions[got.seq])
    assert await store.max_seq() == 9


async def test_profiles_upsert(store: Store) -> None:
    assert await store.load_profiles() == []
    store.save_profiles([("math", "exec|cpu", 1.5, 1), ("math", "api|api.search|GET /", 0.25, 4)])
    store.save_profiles([])
    await store.flush()
    store.save_profiles([("math", "exec|cpu", 1.75, 2), ("code", "exec|cpu", 9.0, 1)])
    assert sorted(await store.load_profiles()) == [
        ("code", "exec|cpu", 9.0, 1), ("math", "api|api.search|GET /", 0.25, 4), ("math", "exec|cpu", 1.75, 2)]


async def test_concurrent_durable_calls_share_transactions(store: Store) -> None:
    actions = [make_action(seq=i, idempotency_key=f"k{i}") for i in range(500)]
    before = store.commits
    await asyncio.gather(*(store.durable(a) for a in actions))
    transactions = store.commits - before
    assert 1 <= transactions <= 10, transactions
    assert await count(store, ActionRow) == 500
    assert await count(store, TransitionRow) == 500
    assert [a.seq for a in await store.load_unfinished()] == list(range(500))


async def test_write_behind_reaches_database_without_flush(store: Store) -> None:
    action = make_action()
    start = time.monotonic()
    store.save(action)
    query = select(ActionRow.id).where(ActionRow.id == action.id)
    while time.monotonic() - start < 5:
        async with store.engine.connect() as conn:  # straight to the database: Store reads would flush first
            if await conn.scalar(query) is not None:
                break
        await asyncio.sleep(0.005)
    elapsed = time.monotonic() - start
    assert store.commits == 1
    assert elapsed < 1.0, elapsed


async def test_close_writes_pending_records(store_url: str, store: Store) -> None:
    lazy = await Store.open(store_url, write_delay_s=60)  # nothing but close() would write in time
    actions = [make_action(seq=i) for i in range(20)]
    for action in actions:
        lazy.save(action)
    lazy.save_profiles([("math", "exec|cpu", 2.0, 3)])
    await lazy.close()
    assert lazy.commits == 1
    await lazy.close()  # idempotent
    with pytest.raises(RuntimeError):
        lazy.save(make_action())
    for action in actions:
        assert_same(await store.get(action.id), action)
    assert await store.load_profiles() == [("math", "exec|cpu", 2.0, 3)]


async def test_restart_resumes_transition_tracking(store_url: str, store: Store) -> None:
    action = make_action()
    await store.durable(action)
    action.state, action.started_at = State.RUNNING, action.submitted_at + 1
    await store.durable(action)
    await store.close()
    reopened = await Store.open(store_url)
    try:
        [resumed] = await reopened.load_unfinished()
        await reopened.durable(resumed)  # unchanged state: no new transition
        resumed.state, resumed.finished_at = State.SUCCEEDED, resumed.submitted_at + 2
        await reopened.durable(resumed)
        assert [s for s, _ in await reopened.transitions(action.id)] == ["queued", "running", "succeeded"]
    finally:
        await reopened.close()


async def test_failed_writes_are_kept_and_retried(store_url: str) -> None:
    store = await Store.open(store_url, max_attempts=2, backoff_s=0.02)
    healthy = store.engine, store._sqlite, store._postgres
    url = make_url(store_url)
    if url.get_backend_name() == "sqlite":
        broken_url = url.set(database="/nonexistent-dir/tangram.db")
        store._sqlite = SqliteWriter("/nonexistent-dir/tangram.db")  # the writer's own connection fails alike
    else:
        broken_url = url.set(port=1)
    store.engine = create_async_engine(broken_url)  # every connection attempt fails, as during an outage
    if store._postgres is not None:
        await store._postgres.close()
        store._postgres = PostgresWriter(store.engine)  # the writer's own connection fails alike
    try:
        action = make_action()
        with pytest.raises(Exception) as failure:
            await store.durable(action)
        assert not isinstance(failure.value, IntegrityError)
        assert store.failures >= 2 and store.commits == 0
        await store.engine.dispose()
        if store._sqlite is not None:
            await store._sqlite.close()
        store.engine, store._sqlite, store._postgres = healthy  # the database is back: the retry loop writes it
        await store.flush()
        assert store.failures == 0
        assert_same(await store.get(action.id), action)
        assert await store.transitions(action.id) == [("queued", action.submitted_at)]
    finally:
        store.engine, store._sqlite, store._postgres = healthy
        await store.close()


@pytest.mark.postgres
async def test_a_commit_whose_connection_died_is_retried_on_a_new_one(postgres_url: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The PostgreSQL writer holds one connection for its commits: when the server drops it (a restart, an idle
    timeout, an operator's ``pg_terminate_backend``), that commit fails, the connection is let go and the retry
    takes a new one; the caller sees only the commit, a moment later."""
    store = await Store.open(postgres_url, backoff_s=0.02)
    try:
        first, second = make_action(seq=1), make_action(seq=2)
        await store.durable(first)
        async with store.engine.connect() as conn:
            ended = await conn.scalar(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                           "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
        assert ended >= 1  # the writer's connection among them
        await store.durable(second)
        assert "store write of 1 actions failed (attempt 1)" in caplog.text
        assert store.commits == 2 and store.failures == 0
        assert [a.id for a in await store.load_unfinished()] == [first.id, second.id]
    finally:
        await store.close()


async def test_a_database_from_an_older_version_gets_its_new_columns_at_open(store_url):
    """A table of an older version lacks a column this one has: a nullable one is added at open, on SQLite and
    PostgreSQL alike, the rows already there reading NULL; one that rows cannot lack is refused naming it, with the
    database left as it was."""
    store = await Store.open(store_url)
    old = make_action(trajectory="t-old")
    store.save(old)
    await store.flush()
    async with store.engine.begin() as conn:  # as an older version, which had neither column, left it
        await conn.execute(text("ALTER TABLE actions DROP COLUMN trajectory"))
        await conn.execute(text("ALTER TABLE speedups DROP COLUMN runs"))
    await store.close()
    with pytest.raises(ConfigError) as refused:
        await Store.open(store_url)
    assert refused.value.key == "store.url" and "speedups.runs" in refused.value.reason
    assert "actions.trajectory" not in refused.value.reason  # only what cannot be added is named
    probe = create_async_engine(store_url)
    async with probe.begin() as conn:
        columns = await conn.run_sync(lambda sync: {c["name"] for c in inspect(sync).get_columns("actions")})
        assert "trajectory" not in columns, "nothing changed on a refusal"
        await conn.execute(text("DROP TABLE speedups"))  # the table goes whole: create_all makes it again
    await probe.dispose()
    store = await Store.open(store_url)
    try:
        new = make_action(trajectory="t-new")
        store.save(new)
        await store.flush()
        async with store.engine.connect() as conn:
            rows = dict((await conn.execute(text("SELECT id, trajectory FROM actions"))).all())
        assert rows == {old.id: None, new.id: "t-new"}
        assert (await store.get(old.id)).trajectory == "t-old"  # the record itself keeps it
    finally:
        await store.close()


#: the ``actions`` table and its indexes as a version before the partial indexes made them (DOUBLE: SQLite's name)
OLDER_ACTIONS = (
    ("CREATE TABLE actions (id VARCHAR NOT NULL, seq BIGINT NOT NULL, task VARCHAR NOT NULL, trajectory VARCHAR, "
     "kind VARCHAR NOT NULL, state VARCHAR NOT NULL, idempotency_key VARCHAR, signature VARCHAR NOT NULL, "
     "submitted_at DOUBLE NOT NULL, started_at DOUBLE, finished_at DOUBLE, record TEXT NOT NULL, PRIMARY KEY (id), "
     "CONSTRAINT uq_actions_task_idempotency_key UNIQUE (task, idempotency_key))"),
    "CREATE INDEX ix_actions_state ON actions (state)",
    "CREATE INDEX ix_actions_kind_state_finished_at ON actions (kind, state, finished_at)",
)


async def _index_definitions(store: Store) -> dict[str, str]:
    """The ``actions`` table's indexes by name, as the database states them (those it made for a constraint aside)."""
    async with store.engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            rows = await conn.exec_driver_sql("SELECT name, sql AS definition FROM sqlite_master WHERE type = "
                                              "'index' AND tbl_name = 'actions' AND sql IS NOT NULL")
        else:
            rows = await conn.exec_driver_sql(
                "SELECT indexname AS name, indexdef AS definition FROM pg_indexes WHERE tablename = 'actions' AND "
                "indexname NOT IN "
                "(SELECT conname FROM pg_constraint WHERE conrelid = 'actions'::regclass)")
        return {row["name"]: row["definition"] for row in rows.mappings()}


async def test_a_database_from_an_older_version_gets_the_partial_indexes_at_open(store_url: str) -> None:
    """``create_all`` leaves existing tables alone, indexes included: an upgraded broker replaces the indexes it
    superseded itself, or the restart's searches scan every action ever stored (and every write keeps paying for
    the old ones). The older unique constraint stays (SQLite cannot drop one) and still refuses a reused key."""
    url = make_url(store_url)
    if url.get_backend_name() == "sqlite":
        assert url.database is not None
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    older = create_async_engine(store_url)
    async with older.begin() as conn:
        for statement in OLDER_ACTIONS:
            await conn.exec_driver_sql(statement if conn.dialect.name == "sqlite"
                                       else statement.replace("DOUBLE", "DOUBLE PRECISION"))
    await older.dispose()
    store = await Store.open(store_url)
    try:
        lease = make_action(seq=1, kind="lease", demand={"lease.a": 1})
        lease.state, lease.finished_at, lease.result = State.SUCCEEDED, time.time(), {"expires_in_s": 60}
        queued = make_action(seq=2, idempotency_key="k1")
        await store.durable(lease, queued)
        assert [a.id for a in await store.load_granted_leases(since=time.time() - 60)] == [lease.id]
        assert [a.id for a in await store.load_unfinished()] == [queued.id]
        with pytest.raises(IntegrityError):
            await store.durable(make_action(seq=3, idempotency_key="k1"))
        assert set(await _index_definitions(store)) == {"ix_actions_unfinished", "ix_actions_leases"}
        unfinished, leases = await _plans(store, store.load_unfinished, lambda: store.load_granted_leases(0))
        assert "ix_actions_unfinished" in unfinished and "ix_actions_leases" in leases
    finally:
        await store.close()


async def _plans(store: Store, *reads: Callable[[], Awaitable[object]]) -> list[str]:
    """The database's plan of the one query each of ``reads`` runs, with its parameters."""
    executed: list[tuple[str, Any]] = []

    def note(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        executed.append((statement, parameters))

    event.listen(store.engine.sync_engine, "before_cursor_execute", note)
    try:
        for read in reads:
            await read()
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", note)
    plans = []
    async with store.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            await conn.exec_driver_sql("SET enable_seqscan = off")  # a table this small is read whole otherwise
        for statement, parameters in executed:
            explain = "EXPLAIN QUERY PLAN " if conn.dialect.name == "sqlite" else "EXPLAIN "
            plans.append(str((await conn.exec_driver_sql(explain + statement, parameters)).all()))
    return plans


async def test_each_index_on_actions_holds_only_the_rows_its_query_reads(store: Store) -> None:
    """Most actions end as soon as they start (a lease, a short exec): an index only of unfinished actions, one only
    of leases and one only of keyed actions leave such rows out of two or three indexes each, and every restart
    search and key lookup still finds its rows through its index."""
    running = make_action(seq=1)
    running.state = State.RUNNING
    ended = make_action(seq=2, idempotency_key="k1")
    ended.state, ended.finished_at = State.SUCCEEDED, time.time()
    lease = make_action(seq=3, kind="lease", demand={"lease.a": 1})
    lease.state, lease.finished_at = State.SUCCEEDED, time.time()
    queued = make_action(seq=4)
    await store.durable(running, ended, lease, queued)
    assert [a.id for a in await store.load_unfinished()] == [running.id, queued.id]
    assert [a.id for a in await store.load_granted_leases(since=0)] == [lease.id]
    definitions = await _index_definitions(store)
    assert set(definitions) == {"ix_actions_unfinished", "ix_actions_leases", "uq_actions_task_idempotency_key"}
    assert all(" WHERE " in definition for definition in definitions.values())
    unfinished, leases, keyed = await _plans(store, store.load_unfinished, lambda: store.load_granted_leases(0),
                                             lambda: store.find_many_by_idempotency([("math", "k1")]))
    assert "ix_actions_unfinished" in unfinished
    assert "ix_actions_leases" in leases
    assert "uq_actions_task_idempotency_key" in keyed


def test_a_record_is_rebuilt_whatever_the_request_limits_are_now() -> None:
    """Records were checked when submitted; the store's codec does not check them again, so a record beyond
    today's request limits (a demand, a deadline, a derived signature longer than a client may send) still loads."""
    action = rich_action()
    action.demands["cpu"] = Demand.range(1, 2_000_000)  # over the parser's million units
    action.timeout_s = 1e9
    action.signature = "exec|" + "x" * 1000
    rebuilt = action_from_stored(stored_record(action))
    assert rebuilt.to_json() == action.to_json()
    assert rebuilt.elasticity == action.elasticity and rebuilt.seq == action.seq


async def test_slo_plans_are_kept_replaced_and_deleted_at_once(store: Store, store_url: str) -> None:
    plan = {"slowdown": 1.2, "service": "judge", "actions": 8, "action_s": 2.0, "other_s": 30.0,
            "dedicated_gpus": 1, "efficiency": 1.0}
    await store.put_slo_plan("b", plan, at=2.0)
    await store.put_slo_plan("a", {**plan, "slowdown": 1.5}, at=1.0)
    await store.put_slo_plan("a", {**plan, "slowdown": 2.0}, at=3.0)  # replaced, and now the newest
    assert await store.load_slo_plans() == {"b": plan, "a": {**plan, "slowdown": 2.0}}
    assert list(await store.load_slo_plans()) == ["b", "a"]  # oldest first
    assert await store.delete_slo_plan("b") is True
    assert await store.delete_slo_plan("b") is False
    reopened = await Store.open(store_url)  # committed at once: another store sees it
    try:
        assert await reopened.load_slo_plans() == {"a": {**plan, "slowdown": 2.0}}
    finally:
        await reopened.close()


async def test_the_sqlite_writer_commits_all_or_nothing_and_reports_as_sqlalchemy_does(tmp_path: Path) -> None:
    database = str(tmp_path / "w.db")
    writer = SqliteWriter(database)
    try:
        await writer.commit([("CREATE TABLE t (k TEXT PRIMARY KEY)", [()])])
        await writer.commit([("INSERT INTO t VALUES (?)", [("a",), ("b",)])])
        with pytest.raises(IntegrityError):  # what the store's refusal path reads (``refusals.py``)
            await writer.commit([("INSERT INTO t VALUES (?)", [("c",)]), ("INSERT INTO t VALUES (?)", [("a",)])])
        await writer.commit([("INSERT INTO t VALUES (?)", [("d",)])])  # the writer goes on after a refusal
    finally:
        await writer.close()
    with sqlite3.connect(database) as reader:
        assert sorted(row[0] for row in reader.execute("SELECT k FROM t")) == ["a", "b", "d"]  # "c" rolled back
