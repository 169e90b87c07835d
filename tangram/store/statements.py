"""Write statements for the engine's dialect, compiled once: a flush's bulk upserts and inserts cost the driver's
time, not Python's."""

from __future__ import annotations

import operator
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tangram.store.tables import Base


def dialect_of(engine: AsyncEngine) -> Any:
    """The dialect module whose ``insert`` knows ON CONFLICT: PostgreSQL's, or SQLite's."""
    return postgresql if engine.dialect.name == "postgresql" else sqlite


class Bulk:
    """A statement compiled once for the engine's dialect and run through the driver's executemany.

    Core's executemany processes every parameter set in Python, about a third of the CPU a written row costs
    here; our column types need no bind processing, so rows go to the driver as plain tuples.
    """

    def __init__(self, engine: AsyncEngine, statement: Any, keys: list[str] | None = None) -> None:
        compiled = statement.compile(dialect=engine.dialect, column_keys=keys, for_executemany=True)
        self.sql = compiled.string
        self.values = operator.itemgetter(*compiled.positiontup)

    def params(self, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        """``rows`` as the driver's parameter tuples."""
        return [self.values(row) for row in rows]

    async def run(self, conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
        await conn.exec_driver_sql(self.sql, self.params(rows))


def upsert(dialect: Any, table: type[Base], keys: list[str]) -> Any:
    """INSERT ... ON CONFLICT (keys) DO UPDATE of every other column, executed with many parameter sets."""
    statement = dialect.insert(table)
    columns = [column.name for column in table.__table__.columns if column.name not in keys]
    return statement.on_conflict_do_update(index_elements=keys,
                                           set_={name: statement.excluded[name] for name in columns})
