"""A standby broker (issue 17): two brokers on one PostgreSQL store, one leads and the other answers where it is;
the leader killed with SIGKILL, the standby takes over, resumes the queue by the crash-recovery rules, and a client
given both URLs sees every action end exactly once, none run twice (checked through the store and the commands'
own record of their runs)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import Counter
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from tangram.config import load_config
from tangram.core.errors import ConfigError
from tangram.leadership import LOCK_KEY, Leadership, asyncpg_dsn, fence
from tangram.store.fence import Deposed
from tangram.store.store import Store
from tangram_client.client import AsyncTangramClient
from tests.docker_nodes import new_broker_id
from tests.test_recovery import free_port, start_broker
from tests.test_store import make_action

ACTIONS = 40


def broker_config(path: Path, store_url: str, broker_id: str, run_dir: str, port: int) -> Path:
    """Both brokers share the store, the broker id (so the new leader adopts the old one's sandboxes) and the
    run directory; each advertises its own URL."""
    path.write_text(f'[store]\nurl = "{store_url}"\nleader_election = true\n'
                    f'[server]\nadvertise_url = "http://127.0.0.1:{port}"\n'
                    f'[cpu]\nbroker_id = "{broker_id}"\nrun_dir = "{run_dir}"\ndefault_memory_mb = 64\n'
                    f'[cpu.nodes.here]\nbackend = "local"\nunsandboxed = true\ncores = "0-1"\nmemory_mb = 8192\n')
    return path


async def answer(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status, await response.json()


async def test_the_standby_takes_over_and_every_action_ends_once(postgres_url: str, run_dir: str,
                                                                 tmp_path: Path) -> None:
    ports = free_port(), free_port()
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    broker_id = new_broker_id()
    configs = [broker_config(tmp_path / f"b{i}.toml", postgres_url, broker_id, run_dir, port)
               for i, port in enumerate(ports)]
    ran = tmp_path / "ran"
    leader = await start_broker(configs[0], ports[0])
    standby = await start_broker(configs[1], ports[1])  # its /healthz answers while it stands by
    try:
        status, body = await answer(urls[1] + "/v1/resources")
        assert status == 503 and body["error"]["code"] == "standby" and body["error"]["leader"] == urls[0]
        assert (await answer(urls[1] + "/readyz"))[0] == 503

        # the standby first: it names the leader, and the client goes there
        async with AsyncTangramClient(urls[::-1], task="t", failover_s=60, request_timeout_s=10) as client:
            async def one(i: int) -> str:
                record = await client.submit("exec", {"cpu": 1},
                                             {"command": f'echo "$TANGRAM_ACTION_ID" >> {ran}; sleep 0.3'},
                                             idempotency_key=f"action-{i}", wait=True)
                while not record.terminal:
                    record = await client.wait(record.id)
                return record.id

            submitted = [asyncio.create_task(one(i)) for i in range(ACTIONS)]
            while not ran.exists() or len(ran.read_text().split()) < 4:  # some ran, others run or wait
                await asyncio.sleep(0.05)
            leader.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            await leader.wait()
            while (await _status(urls[1] + "/readyz")) != 200:
                await asyncio.sleep(0.05)
            took_over_s = time.monotonic() - killed_at
            ids = await asyncio.gather(*submitted)
        print(f"failover: the standby was ready {took_over_s:.1f} s after the leader was killed")

        assert len(set(ids)) == ACTIONS  # each submit, retried across brokers, is one action
        status, body = await answer(urls[1] + "/healthz")
        assert status == 200 and body["status"] == "ok"
        standby.send_signal(signal.SIGTERM)  # its last records reach the store
        assert await standby.wait() == 0
        connection = await asyncpg.connect(asyncpg_dsn(postgres_url))
        try:
            rows = await connection.fetch("SELECT id, state FROM actions")
        finally:
            await connection.close()
        states = {row["id"]: row["state"] for row in rows}
        assert set(states) == set(ids), "an action the clients did not submit, or one lost"
        assert set(states.values()) <= {"succeeded", "failed"}
        runs = Counter(ran.read_text().split())
        assert max(runs.values()) == 1, [i for i, n in runs.items() if n > 1]  # nothing ran twice
        assert all(runs[i] == 1 for i, state in states.items() if state == "succeeded")
        assert sum(state == "succeeded" for state in states.values()) >= ACTIONS - 2  # at most the running ones
    finally:
        for process in (leader, standby):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()


async def _status(url: str) -> int:
    try:
        return (await answer(url))[0]
    except aiohttp.ClientConnectionError:
        return 0


async def test_a_deposed_leaders_store_writes_nothing_more(postgres_url: str) -> None:
    """Fencing: a leader whose lock went (its session ended, as in a partition) without its noticing keeps writing
    only until another broker takes over; from then its store's writes are refused and its waiters told why."""
    old = await Leadership.open(postgres_url, "http://old")
    await old.acquire()
    assert old.epoch is not None
    store = await Store.open(postgres_url, fence=fence(old.epoch))
    new: Leadership | None = None
    new_store: Store | None = None
    try:
        before = make_action(task="fenced")
        await store.durable(before)  # still the leader: written
        dsn = asyncpg_dsn(postgres_url)
        admin = await asyncpg.connect(dsn)
        try:  # the database ends the old leader's lock session; its process does not watch the lock here
            await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                                "AND objid = $1 AND granted", LOCK_KEY & 0xFFFFFFFF)
        finally:
            await admin.close()
        new = await Leadership.open(postgres_url, "http://new")
        await asyncio.wait_for(new.acquire(), 10)
        assert new.epoch == old.epoch + 1
        after = make_action(seq=2, task="fenced")
        with pytest.raises(Deposed, match=f"epoch {old.epoch}"):
            await store.durable(after)
        assert store.deposed.is_set()
        new_store = await Store.open(postgres_url, fence=fence(new.epoch))
        assert await new_store.get(before.id) is not None
        assert await new_store.get(after.id) is None  # the old leader's late write never landed
        await new_store.durable(make_action(seq=3, task="fenced"))  # the new leader writes
    finally:
        for closing in (store, new_store):
            if closing is not None:
                with contextlib.suppress(Deposed):
                    await closing.close()
        for leadership in (old, new):
            if leadership is not None:
                await leadership.close()


def test_leader_election_needs_postgresql(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[store]\nurl = "postgresql+asyncpg://u:p@db/tangram"\nleader_election = true\n')
    assert load_config(config, environ={}).store.leader_election
    with pytest.raises(ConfigError) as caught:  # the override keeps the rest of [store], and is checked with it
        load_config(config, environ={"TANGRAM_STORE_URL": "sqlite+aiosqlite:///x.db"})
    assert caught.value.key == "store.leader_election"
    config.write_text('[store]\nurl = "sqlite+aiosqlite:///x.db"\nleader_election = true\n')
    with pytest.raises(ConfigError) as caught:
        load_config(config, environ={})
    assert caught.value.key == "store.leader_election"
