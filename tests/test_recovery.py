"""Crash recovery: a broker killed with SIGKILL and started again on the same store resumes the queued actions in
order, under their idempotency keys, and ends the ones that were running with a reason a client can act on."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import sys
import time
from pathlib import Path

import aiohttp

from tests.harness import live_upstream


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def start_broker(config: Path, port: int) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tangram.cli", "serve", "--config", str(config), "--port", str(port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            try:
                async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                    if response.status == 200:
                        return process
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    process.kill()
    raise AssertionError("the broker did not start")


def stored_state(db: Path, action_id: str) -> str | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT state FROM actions WHERE id = ?", (action_id,)).fetchone()
    return row[0] if row else None


async def test_sigkill_then_restart_resumes_queued_and_fails_running_actions(tmp_path):
    db = tmp_path / "tangram.db"
    async with live_upstream(delay_s=60.0) as upstream:
        config = tmp_path / "tangram.toml"
        config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n'
                          '[basic."lease.local"]\nconcurrency = 1\n'
                          f'[basic."api.slow"]\nconcurrency = 2\nupstream = {{base_url = "{upstream.url}"}}\n')
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        broker = await start_broker(config, port)
        async with aiohttp.ClientSession() as http:
            async def submit(body: dict, key: str) -> tuple[int, dict]:
                async with http.post(f"{url}/v1/actions", json={**body, "idempotency_key": key}) as response:
                    return response.status, await response.json()

            lease = {"task": "t", "kind": "lease", "demand": {"lease.local": 1}, "spec": {"ttl_s": 300}}
            call = {"task": "t", "kind": "api", "demand": {"api.slow": 1},
                    "spec": {"method": "POST", "path": "/slow", "body": {"sleep_s": 60}}}
            _, holder = await submit(lease, "holder")
            waiting = [(await submit(lease, f"waiting-{i}"))[1] for i in range(3)]
            _, running = await submit(call, "running")
            deadline = time.monotonic() + 30
            while stored_state(db, running["id"]) != "running" or upstream.in_flight == 0:
                assert time.monotonic() < deadline, "the api call never started"
                await asyncio.sleep(0.05)
            assert [w["state"] for w in waiting] == ["queued"] * 3

            os.kill(broker.pid, signal.SIGKILL)
            await broker.wait()

            broker = await start_broker(config, port)
            try:
                async with http.get(f"{url}/v1/actions/{running['id']}") as response:
                    ended = await response.json()
                assert ended["state"] == "failed" and ended["error"]["code"] == "broker_restarted", ended
                # the queue resumed in order: the first waiter is granted the unit at once, the others wait
                states = []
                for w in waiting:
                    async with http.get(f"{url}/v1/actions/{w['id']}?wait=true&wait_timeout_s=0.5") as response:
                        states.append((await response.json())["state"])
                assert states == ["succeeded", "queued", "queued"]
                # resubmission under the same key returns the same action (200, not a new one)
                status, again = await submit(lease, "waiting-1")
                assert status == 200 and again["id"] == waiting[1]["id"]
                async with http.get(f"{url}/v1/resources") as response:
                    rows = {r["resource"]: r for r in (await response.json())["resources"]}
                assert rows["lease.local"]["in_use"] == 1 and rows["lease.local"]["queued"] == 2
                assert rows["api.slow"]["in_use"] == 0  # the dead process's call holds nothing here
                async with http.delete(f"{url}/v1/leases/{waiting[0]['id']}") as response:
                    assert response.status == 200
                async with http.get(f"{url}/v1/actions/{waiting[1]['id']}?wait=true&wait_timeout_s=10") as response:
                    assert (await response.json())["state"] == "succeeded"
                assert holder["state"] == "succeeded"
            finally:
                broker.terminate()
                await broker.wait()


async def test_sigterm_drains_running_actions_keeps_the_queue_and_exits_within_the_bound(tmp_path):
    db = tmp_path / "tangram.db"
    async with live_upstream(delay_s=1.5) as upstream:
        config = tmp_path / "tangram.toml"
        config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n[server]\ndrain_s = 20.0\n'
                          f'[basic."api.slow"]\nconcurrency = 1\nupstream = {{base_url = "{upstream.url}"}}\n')
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        broker = await start_broker(config, port)
        call = {"task": "t", "kind": "api", "demand": {"api.slow": 1},
                "spec": {"method": "POST", "path": "/slow", "body": {}}}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/actions", json=call) as response:
                running = await response.json()
            async with http.post(f"{url}/v1/actions", json=call) as response:
                queued = await response.json()
            while upstream.in_flight == 0:
                await asyncio.sleep(0.02)
            waiter = asyncio.ensure_future(http.get(f"{url}/v1/actions/{running['id']}?wait=true"))
            await asyncio.sleep(0.1)
            began = time.monotonic()
            broker.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with http.post(f"{url}/v1/actions", json=call) as response:  # refused while draining
                assert response.status == 503
                assert (await response.json())["error"]["reason"].startswith("the broker is shutting down")
            async with await waiter as response:  # the client waiting on the running call gets its result
                assert (await response.json())["state"] == "succeeded"
            assert await broker.wait() == 0
            assert time.monotonic() - began < 15  # the drain ended with the running call, not at its bound
            assert len(upstream.seen) == 1  # the queued call was not started
            assert stored_state(db, queued["id"]) == "queued"

            broker = await start_broker(config, port)  # the next start runs what was queued
            try:
                async with http.get(f"{url}/v1/actions/{queued['id']}?wait=true&wait_timeout_s=20") as response:
                    assert (await response.json())["state"] == "succeeded"
            finally:
                broker.terminate()
                await broker.wait()


async def test_drain_cancels_what_is_still_running_at_its_bound(tmp_path):
    db = tmp_path / "tangram.db"
    async with live_upstream(delay_s=60.0) as upstream:
        config = tmp_path / "tangram.toml"
        config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n[server]\ndrain_s = 0.5\n'
                          f'[basic."api.slow"]\nconcurrency = 1\nupstream = {{base_url = "{upstream.url}"}}\n')
        port = free_port()
        broker = await start_broker(config, port)
        call = {"task": "t", "kind": "api", "demand": {"api.slow": 1},
                "spec": {"method": "POST", "path": "/slow", "body": {}}}
        async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/v1/actions",
                                                              json=call) as response:
            running = await response.json()
        while upstream.in_flight == 0:
            await asyncio.sleep(0.02)
        began = time.monotonic()
        broker.send_signal(signal.SIGTERM)
        assert await broker.wait() == 0
        assert time.monotonic() - began < 10
        assert stored_state(db, running["id"]) == "cancelled"
