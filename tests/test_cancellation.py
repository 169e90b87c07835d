"""Cancellation and deadlines of running ``exec`` actions on real Docker engines, through both per-action paths
(engine 0: cgroup writes and the in-sandbox executor; engine 1: ``docker exec``): a cancel kills the whole process
tree and frees the cores at once; a client that drops its ``?wait=true`` request does not cancel anything."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import Live, live_broker

TREE = "echo started; sleep 1000 & sleep 1000 & sleep 1000"
COUNT_SLEEPS = "cat /proc/[0-9]*/cmdline | tr '\\0' ' ' | grep -c 'slee[p] 1000' || true"


def config(engine_index: int) -> dict:
    engine = docker_engines()[engine_index]
    return cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 2048}})


def exec_body(command: str, **extra: object) -> dict:
    return {"task": "t", "trajectory": "traj-1", "kind": "exec", "demand": {"cpu": 2},
            "spec": {"command": command}, **extra}


async def cores_in_use(live: Live) -> int:
    _, body = await live.call("GET", "/v1/resources")
    return sum(row["in_use"] for row in body["resources"] if row["resource"] == "cpu")


async def wait_running(live: Live, action_id: str) -> None:
    for _ in range(400):
        _, record = await live.call("GET", f"/v1/actions/{action_id}")
        if record["state"] == "running" and record.get("allocation"):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{action_id} never ran")


@pytest.mark.parametrize("engine_index", [0, 1], ids=["fast-path", "docker-exec"])
async def test_cancel_kills_the_tree_and_frees_the_cores_at_once(tmp_path, engine_index):
    async with live_broker(config(engine_index), str(tmp_path / "t.db")) as live:
        _, ready = await live.call("POST", "/v1/actions?wait=true", json=exec_body("true"))  # the sandbox exists
        assert ready["state"] == "succeeded"
        _, record = await live.call("POST", "/v1/actions", json=exec_body(TREE))
        await wait_running(live, record["id"])
        await asyncio.sleep(0.3)  # the tree has started
        assert await cores_in_use(live) == 2
        status, cancelled = await live.call("DELETE", f"/v1/actions/{record['id']}")
        assert status == 200 and cancelled["state"] == "cancelled"
        assert await cores_in_use(live) == 0  # freed when the DELETE answers, not later
        # the executor kills the tree when the broker drops the command's connection, just after the DELETE answers
        counts = []
        for _ in range(50):
            _, survivors = await live.call("POST", "/v1/actions?wait=true", json=exec_body(COUNT_SLEEPS))
            assert survivors["state"] == "succeeded", survivors
            counts.append(int(survivors["result"]["stdout"]))
            if counts[-1] == 0:
                break
            await asyncio.sleep(0.1)
        assert counts[0] <= 3 and counts[-1] == 0, counts


async def test_a_client_dropping_its_wait_does_not_cancel(tmp_path):
    async with live_broker(config(0), str(tmp_path / "t.db")) as live:
        body = exec_body("sleep 1; echo done")
        body["idempotency_key"] = "dropped"
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as impatient:
            with pytest.raises(TimeoutError):
                async with impatient.post(f"{live.url}/v1/actions?wait=true", json=body):
                    pass
        status, record = await live.call("POST", "/v1/actions", json=body)
        assert status == 200 and record["state"] == "running"  # the dropped request's action, by its key
        _, record = await live.call("GET", f"/v1/actions/{record['id']}?wait=true&wait_timeout_s=30")
        assert record["state"] == "succeeded" and record["result"]["stdout"] == "done\n"
