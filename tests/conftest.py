"""Shared pytest fixtures."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from sqlalchemy.ext.asyncio import create_async_engine

from managers.remote.broker.ray_loopback import keep_ray_on_loopback
from sandboxes.backend import LABEL_BROKER
from tangram.store.store import Store
from tangram.store.tables import Base
from tests import needs
from tests.docker_nodes import SESSION_BROKER_PREFIX, USERNS_ENV, configured_engines, labelled_containers
from tests.slow_modules import left_out

# ---------------------------------------------------------------------------------------------------------------
# Store fixtures: every store test runs on real SQLite (a file under tmp_path) and on real PostgreSQL.
# PostgreSQL comes from TANGRAM_TEST_PG_URL (scripts/start-postgres.sh starts one and prints the export line).
# Without it the postgres cases fail under CI (env CI set) and are skipped elsewhere.
# ---------------------------------------------------------------------------------------------------------------

PG_URL_ENV = "TANGRAM_TEST_PG_URL"

# Every Ray cluster the suite starts runs Ray's token authentication with this session's token, as a deployment
# should (the broker refuses a cluster without one: [ray] auth), and stays on 127.0.0.1 (issue 35). Ray reads both
# once per process, so they are set here, before any test module imports Ray; raylets and subprocess brokers
# inherit them.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
keep_ray_on_loopback()


@pytest_asyncio.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database per backend: a new SQLite file, or the PostgreSQL test database with our tables dropped."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/store/tangram.db"
    return await empty_postgres()


@pytest_asyncio.fixture
async def postgres_url() -> str:
    """The PostgreSQL test database, our tables dropped (for tests that only make sense on PostgreSQL)."""
    return await empty_postgres()


async def empty_postgres() -> str:
    url = os.environ.get(PG_URL_ENV)
    if not url:
        message = (f"{PG_URL_ENV} is not set: run `eval \"$(scripts/start-postgres.sh)\"` (as root) to start "
                   "PostgreSQL and export it")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    await reset_database(url)
    return url


async def reset_database(url: str) -> None:
    """Drop the tables declared on the store's metadata; Store.open recreates them."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
    finally:
        await engine.dispose()


@pytest_asyncio.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    """An open Store on an empty database, closed after the test."""
    opened = await Store.open(store_url)
    try:
        yield opened
    finally:
        await opened.close()

# ------------------------------------------------- end of store fixtures ---------------------------------------


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    needs.mark(items)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module the ``-m`` expression leaves out whole is not imported (``tests/slow_modules.py``)."""
    return True if left_out(collection_path, config.getoption("markexpr")) else None


@pytest.fixture
def run_dir() -> Iterator[str]:
    """A short directory for local sandboxes: their executor socket paths must fit in 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="tg-") as path:
        yield path


@pytest.fixture(scope="session", autouse=True)
def no_sandbox_outlives_the_suite() -> Iterator[None]:
    """After the whole suite, no sandbox of a broker this session made may remain on any test engine (another
    session's, on shared engines, is left alone)."""
    yield
    leftovers: dict[str, list[str]] = {}
    for engine in [*configured_engines(), *filter(None, [os.environ.get(USERNS_ENV)])]:
        for container in labelled_containers(engine):
            if container.labels.get(LABEL_BROKER, "").startswith(SESSION_BROKER_PREFIX):
                leftovers.setdefault(engine, []).append(container.name)
                container.remove(force=True)
    assert not leftovers, f"sandbox containers outlived the suite: {leftovers}"
