"""Crash recovery: a broker killed with SIGKILL and started again on the same store resumes the queued actions in
order, under their idempotency keys, ends the ones that were running with a reason a client can act on, holds
again the leases its clients still hold, and adopts the sandboxes it left; and graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import docker
import pytest

from sandboxes.backend import LABEL_ENV
from sandboxes.cgroup import ContainerCgroup
from sandboxes.local import kill_marked
from tests.docker_nodes import cpu_config, docker_engines, labelled_containers, new_broker_id
from tests.harness import live_broker, live_upstream

pytestmark = pytest.mark.slow  # brokers in subprocesses, killed and restarted


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def start_broker(config: Path, port: int, timeout_s: float = 60.0,
                       log: Path | None = None) -> asyncio.subprocess.Process:
    """``tangram serve`` on ``port``, once its /healthz answers; its stderr into ``log`` (None: dropped)."""
    with log.open("wb") if log is not None else contextlib.nullcontext() as sink:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tangram.cli", "serve", "--config", str(config), "--port", str(port),
            stdout=asyncio.subprocess.DEVNULL, stderr=sink if log is not None else asyncio.subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline and process.returncode is None:
            try:
                async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                    if response.status == 200:
                        return process
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
    if process.returncode is None:
        process.kill()
    raise AssertionError("the broker did not start" + (f": {log.read_text()[-2000:]}" if log is not None else ""))


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
                # the holder's lease is held again, so the resumed queue waits behind it
                states = []
                for w in waiting:
                    async with http.get(f"{url}/v1/actions/{w['id']}?wait=true&wait_timeout_s=0.5") as response:
                        states.append((await response.json())["state"])
                assert states == ["queued", "queued", "queued"]
                # resubmission under the same key returns the same action (200, not a new one)
                status, again = await submit(lease, "waiting-1")
                assert status == 200 and again["id"] == waiting[1]["id"]
                async with http.get(f"{url}/v1/resources") as response:
                    rows = {r["resource"]: r for r in (await response.json())["resources"]}
                assert rows["lease.local"]["in_use"] == 1 and rows["lease.local"]["queued"] == 3
                assert rows["api.slow"]["in_use"] == 0  # the dead process's call holds nothing here
                # returning the old lease lets the queue go on, in its old order
                for returned, granted in ((holder, waiting[0]), (waiting[0], waiting[1])):
                    async with http.delete(f"{url}/v1/leases/{returned['id']}") as response:
                        assert response.status == 200
                    async with http.get(f"{url}/v1/actions/{granted['id']}?wait=true&wait_timeout_s=10") as response:
                        assert (await response.json())["state"] == "succeeded"
                async with http.get(f"{url}/v1/actions/{waiting[2]['id']}") as response:
                    assert (await response.json())["state"] == "queued"
            finally:
                broker.terminate()
                await broker.wait()


#: a call to the upstream's slow endpoint, through a resource of one unit
SLOW_CALL = {"task": "t", "kind": "api", "demand": {"api.slow": 1},
             "spec": {"method": "POST", "path": "/slow", "body": {}}}


def slow_api_config(tmp_path: Path, upstream_url: str, drain_s: float) -> Path:
    """A broker config with SQLite in ``tmp_path``, the drain bound and ``api.slow`` (one unit) on the upstream."""
    config = tmp_path / "tangram.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path / "tangram.db"}"\n[server]\ndrain_s = {drain_s}\n'
                      f'[basic."api.slow"]\nconcurrency = 1\nupstream = {{base_url = "{upstream_url}"}}\n')
    return config


async def test_sigterm_drains_running_actions_keeps_the_queue_and_exits_within_the_bound(tmp_path):
    db = tmp_path / "tangram.db"
    async with live_upstream(delay_s=1.5) as upstream:
        config = slow_api_config(tmp_path, upstream.url, drain_s=20.0)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        broker = await start_broker(config, port)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/actions", json=SLOW_CALL) as response:
                running = await response.json()
            async with http.post(f"{url}/v1/actions", json=SLOW_CALL) as response:
                queued = await response.json()
            while upstream.in_flight == 0:
                await asyncio.sleep(0.02)
            waiter = asyncio.ensure_future(http.get(f"{url}/v1/actions/{running['id']}?wait=true"))
            await asyncio.sleep(0.1)
            began = time.monotonic()
            async with http.get(f"{url}/readyz") as response:
                assert response.status == 200
            broker.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with http.post(f"{url}/v1/actions", json=SLOW_CALL) as response:  # refused while draining
                assert response.status == 503
                assert (await response.json())["error"]["reason"].startswith("the broker is shutting down")
            async with http.get(f"{url}/readyz") as response:  # alive, but not ready: send new work elsewhere
                assert response.status == 503 and (await response.json())["status"] == "draining"
            async with http.get(f"{url}/healthz") as response:
                assert response.status == 200
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
        config = slow_api_config(tmp_path, upstream.url, drain_s=0.5)
        port = free_port()
        broker = await start_broker(config, port)
        async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/v1/actions",
                                                              json=SLOW_CALL) as response:
            running = await response.json()
        while upstream.in_flight == 0:
            await asyncio.sleep(0.02)
        began = time.monotonic()
        broker.send_signal(signal.SIGTERM)
        assert await broker.wait() == 0
        assert time.monotonic() - began < 10
        assert stored_state(db, running["id"]) == "cancelled"


async def wait_stored(db: Path, action_id: str, state: str) -> None:
    """Until the write-behind store holds ``state`` for the action, so that a kill cannot outrun it."""
    for _ in range(400):
        if stored_state(db, action_id) == state:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{action_id} never stored as {state}")


class BrokerProcess:
    """``tangram serve`` as a subprocess on a fixed port, so that it can be killed and started again at the same
    address, with a client session for calls to it."""

    def __init__(self, config: Path, http: aiohttp.ClientSession) -> None:
        self.config = config
        self.http = http
        self.port = free_port()
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await start_broker(self.config, self.port)

    async def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            await self.process.wait()

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        async with self.http.request(method, f"http://127.0.0.1:{self.port}{path}", json=body) as response:
            return response.status, await response.json()

    async def record(self, method: str, path: str, body: dict | None = None) -> dict:
        return (await self.call(method, path, body))[1]


@contextlib.asynccontextmanager
async def broker_process(config: Path) -> AsyncIterator[BrokerProcess]:
    """A started broker subprocess, stopped (SIGTERM) at the end whatever happened."""
    async with aiohttp.ClientSession() as http:
        broker = BrokerProcess(config, http)
        await broker.start()
        try:
            yield broker
        finally:
            await broker.stop()


async def test_leases_are_held_again_after_a_crash_until_their_original_expiry(tmp_path):
    """A lease granted by a killed process still holds its units in the next one (its client still uses them) until
    the expiry it was granted with. One whose TTL passed while the broker was down, or whose resource the new config
    lacks, is recorded as returned, saying how."""
    db = tmp_path / "tangram.db"
    kept = f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n' \
           '[basic."lease.a"]\nconcurrency = 1\n[basic."lease.b"]\nconcurrency = 1\n'
    config = tmp_path / "tangram.toml"
    config.write_text(kept + '[basic."lease.gone"]\nconcurrency = 1\n')
    async with broker_process(config) as broker:
        async def lease(resource: str, ttl_s: float) -> dict:
            record = await broker.record("POST", "/v1/actions?wait=true", {
                "task": "t", "kind": "lease", "demand": {resource: 1}, "spec": {"ttl_s": ttl_s}})
            assert record["state"] == "succeeded", record
            await wait_stored(db, record["id"], "succeeded")
            return record

        async def in_use() -> dict[str, int]:
            rows = (await broker.record("GET", "/v1/resources"))["resources"]
            return {row["resource"]: row["in_use"] for row in rows if row["resource"].startswith("lease.")}

        held = await lease("lease.a", 10)  # outlives the restart
        lapsed = await lease("lease.b", 1)  # expires while the broker is down
        orphaned = await lease("lease.gone", 60)  # its resource is not in the next config
        await broker.kill()
        while time.time() < lapsed["finished_at"] + lapsed["result"]["expires_in_s"]:
            await asyncio.sleep(0.05)
        config.write_text(kept)
        await broker.start()

        assert await in_use() == {"lease.a": 1, "lease.b": 0}
        assert "returned" not in (await broker.record("GET", f"/v1/actions/{held['id']}"))["result"]
        record = await broker.record("GET", f"/v1/actions/{lapsed['id']}")
        assert record["result"]["returned"] == "expired", record
        assert (await broker.call("DELETE", f"/v1/leases/{lapsed['id']}"))[0] == 409
        record = await broker.record("GET", f"/v1/actions/{orphaned['id']}")
        assert record["result"]["returned"] == "resource_removed", record

        # another client's lease on lease.a is granted once the old one expires, at the time it was granted for
        waiter = await broker.record("POST", "/v1/actions", {"task": "u", "kind": "lease", "demand": {"lease.a": 1}})
        assert waiter["state"] == "queued"
        waiter = await broker.record("GET", f"/v1/actions/{waiter['id']}?wait=true&wait_timeout_s=30")
        assert waiter["state"] == "succeeded", waiter
        expiry = held["finished_at"] + held["result"]["expires_in_s"]
        assert waiter["started_at"] >= expiry - 0.05  # not one moment earlier (wall and monotonic clocks)
        record = await broker.record("GET", f"/v1/actions/{held['id']}")
        assert record["result"]["returned"] == "expired", record


def stop_container(engine: str, env_id: str) -> None:
    """Kill the environment's container while no broker watches it, as a node's OOM killer or an operator would."""
    client = docker.DockerClient(base_url=engine)
    try:
        [container] = client.containers.list(filters={"label": f"{LABEL_ENV}={env_id}"})
        if container.status == "paused":  # the docker-exec path idles containers so
            container.unpause()
        ContainerCgroup.of_pid(container.attrs["State"]["Pid"]).set_frozen(False)  # the fast path, so
        container.kill()
        container.wait(timeout=30)
    finally:
        client.close()


def exec_body(command: str, trajectory: str | None) -> dict:
    body = {"task": "t", "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": command}}
    return body if trajectory is None else {**body, "trajectory": trajectory}


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "docker-exec"])
async def test_sandboxes_outlive_a_crash_and_are_adopted_or_reported_lost(tmp_path, fast_path):
    """After ``kill -9`` and a restart, a trajectory's sandbox is the same environment (same id, container, files);
    one whose container stopped meanwhile is reported lost with why, so its trajectory is told rather than silently
    given a fresh one; a one-action sandbox is removed. No core is held and no container outlives the broker."""
    engine = docker_engines()[0 if fast_path else 1]
    broker_id = new_broker_id()
    db = tmp_path / "tangram.db"
    config = tmp_path / "tangram.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n'
                      f'[cpu]\nbroker_id = "{broker_id}"\nrun_dir = "/run/tangram/test-sandboxes"\n'
                      f'[cpu.nodes.n1]\nbackend = "docker"\nengine = "{engine}"\ncores = "0-1"\nmemory_mb = 8192\n'
                      f'fast_path = {str(fast_path).lower()}\n')
    async with broker_process(config) as broker:
        first = await broker.record("POST", "/v1/actions?wait=true", exec_body("echo kept > note; hostname", "kept"))
        assert first["state"] == "succeeded", first
        kept_env, host = first["result"]["environment"], first["result"]["stdout"]
        doomed = await broker.record("POST", "/v1/actions?wait=true", exec_body("echo doomed > note", "doomed"))
        doomed_env = doomed["result"]["environment"]
        # at the crash, a command runs in the kept sandbox and a one-action sandbox exists
        interrupted = await broker.record("POST", "/v1/actions", exec_body("sleep 30", "kept"))
        one_off = await broker.record("POST", "/v1/actions", exec_body("sleep 30", None))
        for action in (interrupted, one_off):
            await wait_stored(db, action["id"], "running")
        while len(labelled_containers(engine, broker_id)) < 3:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the one-off command has started
        await broker.kill()
        await asyncio.to_thread(stop_container, engine, doomed_env)
        await broker.start()

        listed = {env["id"]: env for env in (await broker.record("GET", "/v1/environments"))["environments"]}
        assert listed.keys() == {kept_env, doomed_env}
        assert listed[kept_env]["state"] == "ready" and listed[doomed_env]["state"] == "lost"
        assert "stopped while the broker was down" in listed[doomed_env]["lost_reason"]
        assert [c.labels[LABEL_ENV] for c in labelled_containers(engine, broker_id)] == [kept_env]
        record = await broker.record("GET", f"/v1/actions/{interrupted['id']}")
        assert record["error"]["code"] == "broker_restarted", record

        again = await broker.record("POST", "/v1/actions?wait=true", exec_body("cat note; hostname", "kept"))
        assert again["state"] == "succeeded", again
        assert again["result"]["environment"] == kept_env and again["result"]["stdout"] == "kept\n" + host
        told = await broker.record("POST", "/v1/actions?wait=true", exec_body("cat note", "doomed"))
        assert told["state"] == "failed" and told["error"]["code"] == "environment_lost", told
        assert "stopped while the broker was down" in told["error"]["message"]
        assert (await broker.call("DELETE", f"/v1/environments/{doomed_env}"))[0] == 200
        fresh = await broker.record("POST", "/v1/actions?wait=true",
                                    exec_body("cat note 2>/dev/null || echo none", "doomed"))
        assert fresh["state"] == "succeeded" and fresh["result"]["stdout"] == "none\n", fresh
        assert fresh["result"]["environment"] != doomed_env
        rows = (await broker.record("GET", "/v1/resources"))["resources"]
        assert sum(row["in_use"] for row in rows if row["resource"] == "cpu") == 0
    assert labelled_containers(engine, broker_id) == []


async def test_local_sandboxes_are_adopted_or_reported_lost(tmp_path, run_dir):
    """The local-process backend keeps the same promise: its executors outlive a killed broker and are adopted;
    an environment whose executor died meanwhile is reported lost."""
    db = tmp_path / "tangram.db"
    config = tmp_path / "tangram.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n'
                      f'[cpu]\nbroker_id = "{new_broker_id()}"\nrun_dir = "{run_dir}"\ndefault_memory_mb = 64\n'
                      f'[cpu.nodes.here]\nbackend = "local"\nunsandboxed = true\n'
                      f'cores = [{min(os.sched_getaffinity(0))}]\nmemory_mb = 4096\n')
    async with broker_process(config) as broker:
        envs = {}
        for trajectory in ("kept", "doomed"):
            record = await broker.record("POST", "/v1/actions?wait=true",
                                         exec_body(f"echo {trajectory} > note", trajectory))
            envs[trajectory] = record["result"]["environment"]
        await broker.kill()
        await asyncio.to_thread(kill_marked, {envs["doomed"]})
        await broker.start()

        listed = {env["id"]: env["state"] for env in (await broker.record("GET", "/v1/environments"))["environments"]}
        assert listed == {envs["kept"]: "ready", envs["doomed"]: "lost"}
        again = await broker.record("POST", "/v1/actions?wait=true", exec_body("cat note", "kept"))
        assert again["result"]["stdout"] == "kept\n" and again["result"]["environment"] == envs["kept"], again
        told = await broker.record("POST", "/v1/actions?wait=true", exec_body("cat note", "doomed"))
        assert told["error"]["code"] == "environment_lost" and "executor is gone" in told["error"]["message"]
    assert not any(Path(run_dir).rglob("exec.sock"))  # the stop removed every environment


async def test_a_stop_can_keep_sandboxes_for_the_next_start(tmp_path):
    """With ``cpu.keep_sandboxes_on_stop`` a clean stop (an upgrade) leaves trajectory sandboxes idle, and the next
    start carries on in them; without it, a stop removes them."""
    engine = docker_engines()[0]
    raw = cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 4096}},
                     keep_sandboxes_on_stop=True)
    broker_id = raw["cpu"]["broker_id"]
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        _, first = await live.call("POST", "/v1/actions?wait=true", json=exec_body("echo kept > note", "traj"))
        await live.call("POST", "/v1/actions?wait=true", json=exec_body("true", None))  # a one-action sandbox
    assert [c.labels[LABEL_ENV] for c in labelled_containers(engine, broker_id)] == [first["result"]["environment"]]
    raw["cpu"]["keep_sandboxes_on_stop"] = False
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        _, again = await live.call("POST", "/v1/actions?wait=true", json=exec_body("cat note", "traj"))
        assert again["result"]["stdout"] == "kept\n" and again["result"]["environment"] == \
            first["result"]["environment"], again
    assert labelled_containers(engine, broker_id) == []
