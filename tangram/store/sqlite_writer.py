"""The group commit's transactions on a SQLite file, each in one hop to a thread of its own.

Through SQLAlchemy and aiosqlite a commit costs about eight hops between the event loop and aiosqlite's thread
(check-out, begin, each statement, commit, the pool's reset), each a wake-up and a hand-over of the GIL: on a broker
that commits often (few actions at a time, ``?wait=true`` callers), more CPU than the rest of an action. Here the whole
transaction runs as one function on a connection this writer alone uses, in WAL mode beside the engine's readers.
Its errors come back as SQLAlchemy's, so the writer's retry and refusal paths (``refusals.py``) read them unchanged.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy.exc import DBAPIError

from tangram.store.statements import Statement

#: seconds a write waits for another connection's write lock (the engine's, writing tokens or plans)
BUSY_TIMEOUT_S = 5.0


class SqliteWriter:
    """Write transactions on the SQLite file ``database``."""

    def __init__(self, database: str) -> None:
        self._database = database
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tangram-sqlite-writer")
        self._connection: sqlite3.Connection | None = None

    async def commit(self, statements: Sequence[Statement]) -> None:
        """Run ``statements`` in one transaction, all or none."""
        await asyncio.get_running_loop().run_in_executor(self._thread, self._transaction, statements)

    def _transaction(self, statements: Sequence[Statement]) -> None:
        connection = self._connected()
        sql = "BEGIN IMMEDIATE"
        try:
            connection.execute(sql)
            try:
                for sql, rows in statements:
                    connection.executemany(sql, rows)
                sql = "COMMIT"
                connection.execute(sql)
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        except sqlite3.Error as error:
            raise DBAPIError.instance(sql, None, error, sqlite3.Error) from error

    def _connected(self) -> sqlite3.Connection:
        if self._connection is None:
            connection = sqlite3.connect(self._database, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            connection.execute("PRAGMA journal_mode=WAL")  # as the engine's connections (``sqlite.py``)
            connection.execute("PRAGMA synchronous=NORMAL")
            self._connection = connection
        return self._connection

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._disconnect)
        self._thread.shutdown()

    def _disconnect(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
