"""Fault injection through the broker's real HTTP API: for each fault, what the client sees, and that nothing is
lost (every action ends in one terminal state with a reason, units come back, the broker keeps serving)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url

from tangram.store.store import Store
from tests.conftest import PG_URL_ENV, reset_database
from tests.docker_nodes import cpu_config, docker_engines, kill_sandbox
from tests.harness import Live, live_broker

NODE2_PIDFILE = Path("/run/tangram/node2/docker.pid")
REPO = Path(__file__).resolve().parent.parent


def node(engine: str, **extra: object) -> dict:
    return cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 2048, **extra}})


def exec_body(command: str, trajectory: str = "traj-1", **extra: object) -> dict:
    return {"task": "t", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": command}, **extra}


async def cores_in_use(live: Live) -> int:
    _, body = await live.call("GET", "/v1/resources")
    return sum(row["in_use"] for row in body["resources"] if row["resource"] == "cpu")


async def running(live: Live, body: dict) -> dict:
    _, record = await live.call("POST", "/v1/actions", json=body)
    for _ in range(400):
        _, record = await live.call("GET", f"/v1/actions/{record['id']}")
        if record["state"] == "running":
            await asyncio.sleep(0.3)  # the command itself has started
            return record
        await asyncio.sleep(0.025)
    raise AssertionError(f"never ran: {record}")


async def ended(live: Live, action_id: str) -> dict:
    _, record = await live.call("GET", f"/v1/actions/{action_id}?wait=true&wait_timeout_s=60")
    assert record["state"] not in ("queued", "running"), record
    return record


async def test_sandbox_container_killed_mid_exec(tmp_path):
    """The client sees ``environment_lost`` for the running command and for the trajectory's next one (with how to
    recover), the cores come back, and other trajectories keep running."""
    engine = docker_engines()[0]
    async with live_broker(node(engine), str(tmp_path / "t.db")) as live:
        _, first = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo ready"))
        env_id = first["result"]["environment"]
        record = await running(live, exec_body("sleep 60"))
        kill_sandbox(engine, env_id)
        record = await ended(live, record["id"])
        assert record["state"] == "failed" and record["error"]["code"] == "environment_lost", record
        assert "exit code 137" in record["error"]["message"]
        _, later = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo again"))
        assert later["state"] == "failed" and later["error"]["code"] == "environment_lost"
        assert f"DELETE /v1/environments/{env_id}" in later["error"]["message"]  # how to start over
        assert await cores_in_use(live) == 0
        _, other = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo other", "traj-2"))
        assert other["state"] == "succeeded"
        assert (await live.call("DELETE", f"/v1/environments/{env_id}"))[0] == 200
        _, fresh = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo fresh"))
        assert fresh["state"] == "succeeded" and fresh["result"]["environment"] != env_id


def restart_node2() -> None:
    """Start node 2's engine again once the stopped one has exited (scripts/start-docker.sh is idempotent)."""
    pid = int(NODE2_PIDFILE.read_text())
    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    subprocess.run(["bash", "scripts/start-docker.sh"], cwd=REPO, check=True, capture_output=True, timeout=180)


async def test_docker_engine_restarted_mid_exec(tmp_path):
    """Node 2's engine (the ``docker exec`` path) stops under a running command: the client sees
    ``engine_unavailable`` for it and for new sandboxes while the engine is down, ``environment_lost`` for the
    trajectory whose container went with the engine, and everything works again once the engine is back."""
    engine = docker_engines()[1]
    async with live_broker(node(engine, fast_path=False), str(tmp_path / "t.db")) as live:
        _, ready = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo ready"))
        assert ready["state"] == "succeeded"
        record = await running(live, exec_body("sleep 60"))
        os.kill(int(NODE2_PIDFILE.read_text()), signal.SIGTERM)
        try:
            record = await ended(live, record["id"])
            assert record["state"] == "failed" and record["error"]["code"] in ("engine_unavailable",
                                                                               "environment_lost"), record
            _, down = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo x", "traj-3"))
            assert down["state"] == "failed" and down["error"]["code"] == "engine_unavailable", down
            assert engine in down["error"]["message"]
            assert await cores_in_use(live) == 0
        finally:
            await asyncio.to_thread(restart_node2)
        _, back = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo back", "traj-4"))
        assert back["state"] == "succeeded" and back["result"]["stdout"] == "back\n"
        _, old = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo old"))
        assert old["state"] == "failed" and old["error"]["code"] == "environment_lost", old


class OutageProxy:
    """A TCP proxy in front of PostgreSQL that can drop every connection and refuse new ones: the database 'goes
    away' for the broker while the server itself keeps running for the rest of the suite."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.down = False
        self.links: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.links |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.down = True
        for writer in self.links:
            writer.close()
        self.links.clear()

    async def close(self) -> None:
        self.cut()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_database_briefly_unavailable(tmp_path):
    """PostgreSQL goes away under a running broker. A submit with an idempotency key is refused with 503 (the
    broker cannot tell whether the key was used before) and nothing is queued; one without a key is queued and runs
    but answers 503 "not yet durable". Reads keep working from memory. Once the database is back, the retried
    submit is accepted and every record, including the one accepted during the outage, reaches the database."""
    url = make_url(os.environ[PG_URL_ENV])
    await reset_database(url.render_as_string(hide_password=False))
    proxy = OutageProxy(url.host or "127.0.0.1", url.port or 5432)
    port = await proxy.start()
    store_url = url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    leases = {"basic": {"lease.local": {"concurrency": 4}}}
    body = {"task": "t", "kind": "lease", "demand": {"lease.local": 1}, "spec": {"ttl_s": 60}}
    try:
        async with live_broker(leases, str(tmp_path / "unused.db"), store_url=store_url) as live:
            status, before = await live.call("POST", "/v1/actions?wait=true", json={**body, "idempotency_key": "a"})
            assert status == 200 and before["state"] == "succeeded"
            proxy.cut()
            status, keyed = await live.call("POST", "/v1/actions", json={**body, "idempotency_key": "b"})
            assert status == 503 and keyed["error"]["reason"].startswith("the database is unavailable"), keyed
            assert not len(live.broker.queue) and ("t", "b") not in live.broker.idempotency  # nothing taken
            status, unkeyed = await live.call("POST", "/v1/actions", json={**body, "task": "u"})
            assert status == 503 and "not yet durable" in unkeyed["error"]["reason"], unkeyed
            status, read = await live.call("GET", f"/v1/actions/{before['id']}")
            assert status == 200 and read["state"] == "succeeded"  # reads are served from memory meanwhile
            proxy.down = False
            for _ in range(200):  # the client retries under the same key, as AsyncTangramClient does
                status, again = await live.call("POST", "/v1/actions?wait=true",
                                                json={**body, "idempotency_key": "b"})
                if status < 500:
                    break
                await asyncio.sleep(0.1)
            assert status == 200 and again["state"] == "succeeded", again
            await live.broker.store.flush()
        store = await Store.open(store_url)
        try:
            stored = await store.find_by_idempotency("t", "b")
            assert stored is not None and stored.id == again["id"] and stored.state.value == "succeeded"
            async with store.engine.connect() as conn:
                rows = (await conn.execute(text("SELECT task, state FROM actions ORDER BY seq"))).all()
            assert [tuple(row) for row in rows] == [("t", "succeeded"), ("u", "succeeded"), ("t", "succeeded")]
        finally:
            await store.close()
    finally:
        await proxy.close()
