"""Opening the database: SQLite (``sqlite+aiosqlite:///path``) by default, PostgreSQL (``postgresql+asyncpg://...``)
in production, with the broker's tables created, so a fresh database and one from an older version both serve."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from tangram.store.schema_upgrade import upgrade_schema
from tangram.store.sqlite import sqlite_options, sqlite_pragmas
from tangram.store.tables import Base

log = logging.getLogger(__name__)


async def open_engine(url: str) -> AsyncEngine:
    """The engine of ``url``, its tables created where missing and those of an older version brought up to date
    (``schema_upgrade``)."""
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
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
            for statement in await conn.run_sync(upgrade_schema):
                log.warning("store: brought a database from an older version up to date: %s", statement)
    except BaseException:
        await engine.dispose()
        raise
    return engine
