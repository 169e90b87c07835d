"""Write statements for the engine's dialect, compiled once: a flush's bulk upserts and inserts cost the driver's
time, not Python's."""

from __future__ import annotations

import itertools
import operator
import re
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tangram.store.tables import Base


def dialect_of(engine: AsyncEngine) -> Any:
    """The dialect module whose ``insert`` knows ON CONFLICT: PostgreSQL's, or SQLite's."""
    return postgresql if engine.dialect.name == "postgresql" else sqlite


#: rows per multi-row statement, largest first: the powers of two, so a write of n rows takes one statement per binary
#: digit of n (each statement hands the GIL back and forth once per step, so fewer is cheaper under a busy event
#: loop), and nine sizes per table stay within the connection's cache of prepared statements (128); 256 rows of our
#: widest table bind 3,072 values, under SQLite's 32,766
ROW_GROUPS = (256, 128, 64, 32, 16, 8, 4, 2, 1)
#: the one row of values a compiled INSERT binds
_ROW = re.compile(r" VALUES (\((?:\?, )*\?\))")
#: (SQL, its parameter rows): one ``executemany`` of a transaction, as the store's writers run them
Statement = tuple[str, list[tuple[Any, ...]]]


class Bulk:
    """A statement compiled once for the engine's dialect and run through the driver's executemany.

    Core's executemany processes every parameter set in Python, about a third of the CPU a written row costs
    here; our column types need no bind processing, so rows go to the driver as plain tuples.
    """

    def __init__(self, engine: AsyncEngine, statement: Any, keys: list[str] | None = None) -> None:
        """``keys``: the columns bound, in the order of the tuples that ``run`` and ``in_groups`` then take."""
        compiled = statement.compile(dialect=engine.dialect, column_keys=keys, for_executemany=True)
        if keys is not None and list(compiled.positiontup) != keys:
            raise ValueError(f"{compiled.string} binds {compiled.positiontup}, not {keys} in that order")
        self.sql = compiled.string
        self.values = operator.itemgetter(*compiled.positiontup)
        self._grouped: dict[int, str] = {}

    def params(self, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        """``rows`` as the driver's parameter tuples."""
        return [self.values(row) for row in rows]

    def in_groups(self, params: list[tuple[Any, ...]]) -> list[Statement]:
        """Parameter tuples as multi-row INSERTs (``ROW_GROUPS`` rows each), each with its one flat tuple.

        SQLite's executemany steps each row apart and Python's driver lets go of the GIL at every step: while the
        event loop runs, a writer thread then waits for the GIL once per row. One statement per group waits once.
        """
        statements = []
        start = 0
        for size in ROW_GROUPS:
            while len(params) - start >= size:
                group = params[start:start + size]
                statements.append((self._grouped_sql(size), [tuple(itertools.chain.from_iterable(group))]))
                start += size
        return statements

    def _grouped_sql(self, size: int) -> str:
        sql = self._grouped.get(size)
        if sql is None:
            row = _ROW.search(self.sql)
            if row is None:
                raise ValueError(f"not an INSERT of one row of values: {self.sql}")
            sql = f"{self.sql[:row.start(1)]}{', '.join([row.group(1)] * size)}{self.sql[row.end(1):]}"
            self._grouped[size] = sql
        return sql

    async def run(self, conn: AsyncConnection, params: list[tuple[Any, ...]]) -> None:
        await conn.exec_driver_sql(self.sql, params)


def upsert(dialect: Any, table: type[Base], keys: list[str]) -> Any:
    """INSERT ... ON CONFLICT (keys) DO UPDATE of every other column, executed with many parameter sets."""
    statement = dialect.insert(table)
    columns = [column.name for column in table.__table__.columns if column.name not in keys]
    return statement.on_conflict_do_update(index_elements=keys,
                                           set_={name: statement.excluded[name] for name in columns})
