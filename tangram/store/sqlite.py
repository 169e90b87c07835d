"""What a SQLite store needs beyond the URL: a private database file, one shared connection for an in-memory
database, and the pragmas that let readers run beside the flusher."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import StaticPool


def sqlite_options(database: str) -> dict[str, Any]:
    """The engine's options for ``database``; a database file (and its folder) is created first, private."""
    options: dict[str, Any] = {}
    if database in ("", ":memory:"):
        options["poolclass"] = StaticPool  # every connection would otherwise see its own empty database
    elif not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
        create_private(database)
    return options


def create_private(database: str) -> None:
    """Create the SQLite file 0600 before SQLite does (its default is 0644 less the umask): it holds every action's
    spec and result and the tokens' hashes. SQLite gives its journal and WAL files the database file's mode. An
    existing file keeps its mode."""
    try:
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        pass


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """WAL lets readers run beside the flusher; NORMAL skips the fsync per commit (WAL stays consistent)."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def sqlite_file(engine: AsyncEngine) -> str | None:
    """The path of ``engine``'s database when it is a plain SQLite file (not in memory, no URI, no query options),
    which another connection can open as the engine's do; None otherwise."""
    url = engine.url
    database = url.database or ""
    if engine.dialect.name != "sqlite" or database in ("", ":memory:") or database.startswith("file:") or url.query:
        return None
    return database
