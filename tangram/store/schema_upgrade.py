"""Bringing a database made by an older version up to this one's tables at open. ``create_all`` makes only missing
tables: it never adds a column or an index to a table that exists, so without this an upgraded broker on its old
store fails at its first query. The upgrade adds, and drops only the indexes a new one replaces
(``SUPERSEDED_INDEXES``): a new column must be nullable or carry a ``server_default`` (declare it so); one that is
neither is refused naming it, with nothing changed. An older unique constraint stands where an index of its name
replaces it (SQLite cannot drop one without rebuilding the table): it constrains the same rows and more."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, inspect
from sqlalchemy.schema import CreateIndex

from tangram.core.errors import ConfigError
from tangram.store.tables import SUPERSEDED_INDEXES, Base


def upgrade_schema(conn: Any) -> list[str]:
    """Add the columns and indexes this version's tables have and the database lacks (in the open transaction);
    the DDL statements it ran, for the log."""
    inspector = inspect(conn)  # after create_all: every table exists
    missing_columns = []
    for table in Base.metadata.sorted_tables:
        have = {column["name"] for column in inspector.get_columns(table.name)}
        missing_columns += [column for column in table.columns if column.name not in have]
    unaddable = [c for c in missing_columns if not c.nullable and c.server_default is None]
    if unaddable:
        raise ConfigError("store.url", f"the database was made by an older version and lacks the column(s) "
                                       f"{', '.join(f'{c.table.name}.{c.name}' for c in unaddable)}, which cannot be "
                                       f"added to rows already there: migrate it by hand, or start on a new database")
    ran = [_add_column(conn, column) for column in missing_columns]
    for table in Base.metadata.sorted_tables:
        have_indexes = {index["name"] for index in inspector.get_indexes(table.name)}
        for name in SUPERSEDED_INDEXES.get(table.name, ()):
            if name in have_indexes:
                conn.exec_driver_sql(f"DROP INDEX {conn.dialect.identifier_preparer.quote(name)}")
                ran.append(f"DROP INDEX {name}")
        have_indexes |= {constraint["name"] for constraint in inspector.get_unique_constraints(table.name)}
        for index in table.indexes:
            if index.name not in have_indexes:
                conn.execute(CreateIndex(index))
                ran.append(f"CREATE INDEX {index.name}")
    return ran


def _add_column(conn: Any, column: Column[Any]) -> str:
    dialect = conn.dialect
    preparer = dialect.identifier_preparer
    ddl = (f"ALTER TABLE {preparer.format_table(column.table)} ADD COLUMN {preparer.format_column(column)} "
           f"{column.type.compile(dialect=dialect)}")
    if column.server_default is not None:
        ddl += f" DEFAULT {column.server_default.arg}"  # type: ignore[attr-defined]
    if not column.nullable:
        ddl += " NOT NULL"
    conn.exec_driver_sql(ddl)
    return ddl
