"""Opening the database: SQLite (``sqlite+aiosqlite:///path``) by default, PostgreSQL (``postgresql+asyncpg://...``)
in production, with the broker's tables created, so a fresh database and one from an older version both serve."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from tangram.store.sqlite import sqlite_options, sqlite_pragmas
from tangram.store.tables import Base, create_missing_indexes


async def open_engine(url: str) -> AsyncEngine:
    """The engine of ``url``, its tables and their indexes created where missing."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    options: dict[str, Any] = {}
    if backend == "sqlite":
        options = sqlite_options(parsed.database or "")
    elif backend != "postgresql":
        raise ValueError(f"unsupported database {backend!r}: use sqlite+aiosqlite or postgresql+asyncpg")
    engine = create_async_engine(parsed, **options)
    if backend == "sqlite":
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
        await conn.run_sync(create_missing_indexes)
    return engine
