"""The group commit's transactions on PostgreSQL, straight through asyncpg on one connection held for them.

Through SQLAlchemy a commit also costs a pool check-out and its reset (a ROLLBACK round trip), a greenlet switch per
call and the cursor adapter's work per statement: for the small commits of submits one per request, about as much of
the broker's CPU as the statements themselves. Here a transaction is asyncpg's own: BEGIN, one pipelined
``executemany`` per statement, COMMIT. Errors come back as SQLAlchemy's, by SQLSTATE class, so the writer's retry
and refusal paths (``refusals.py``) read them unchanged. A connection that failed for any other reason than the data
is dropped, and the next commit takes a new one from the engine's pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress

import asyncpg
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tangram.store.statements import Statement

#: SQLSTATE classes of the data's own faults, which no retry mends and which leave the connection sound
_REFUSALS: dict[str, type[DBAPIError]] = {"22": DataError, "23": IntegrityError}


class PostgresWriter:
    """Write transactions on ``engine``'s PostgreSQL database."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._held: AsyncConnection | None = None
        self._driver: asyncpg.Connection | None = None

    async def commit(self, statements: Sequence[Statement]) -> None:
        """Run ``statements`` (each an ``executemany``) in one transaction, all or none."""
        connection = await self._connection()
        sql = "BEGIN"
        try:
            async with connection.transaction():
                for sql, rows in statements:
                    await connection.executemany(sql, rows)
        except asyncpg.PostgresError as error:
            refusal = _REFUSALS.get((error.sqlstate or "")[:2])
            if refusal is not None:
                raise refusal(sql, None, error) from error
            await self._drop()
            raise DBAPIError(sql, None, error) from error
        except Exception as error:  # the connection is lost
            await self._drop()
            raise DBAPIError(sql, None, error, connection_invalidated=True) from error
        except BaseException:  # cancelled mid-transaction: what the connection holds is not known
            await self._drop()
            raise

    async def _connection(self) -> asyncpg.Connection:
        if self._driver is None:
            held = await self._engine.connect()
            try:
                self._driver = (await held.get_raw_connection()).driver_connection
            except BaseException:
                await held.close()
                raise
            self._held = held
        return self._driver

    async def _drop(self) -> None:
        held, self._held, self._driver = self._held, None, None
        if held is not None:
            with suppress(Exception):
                await held.invalidate()
                await held.close()

    async def close(self) -> None:
        held, self._held, self._driver = self._held, None, None
        if held is not None:
            await held.close()
