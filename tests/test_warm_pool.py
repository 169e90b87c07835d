"""Warm sandboxes on a real Docker engine (issue 17): a node keeps started, frozen sandboxes that a new trajectory's
first exec claims (with its identity and files), refills them in the background, survives a restart through the
claim's record, and queues a burst of creates under its rate limit instead of failing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from sandboxes.backend import LABEL_ENV, LABEL_WARM, Sandbox, SandboxError, SandboxSpec
from sandboxes.exec_wire import ExecRequest, ExecResult
from sandboxes.warm_pool import CreateRate, WarmPool
from tests.docker_nodes import cpu_config, docker_engines, labelled_containers
from tests.harness import Live, live_broker, until


def warm_node(engine: str, **cpu: Any) -> dict[str, Any]:
    return cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 8192}},
                      default_memory_mb=128, **cpu)


def warm_ids(engine: str, broker_id: str) -> set[str]:
    return {c.labels[LABEL_ENV] for c in labelled_containers(engine, broker_id) if c.labels.get(LABEL_WARM) == "1"}


async def first_exec(live: Live, trajectory: str, command: str, **spec: Any) -> dict[str, Any]:
    body = {"task": "t", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": command, **spec}}
    _, record = await live.call("POST", "/v1/actions?wait=true", json=body)
    return record


async def test_a_new_trajectory_claims_a_warm_sandbox_and_keeps_it_across_a_restart(tmp_path) -> None:
    engine = docker_engines()[0]
    raw = warm_node(engine, warm_sandboxes=2, keep_sandboxes_on_stop=True)
    broker_id = raw["cpu"]["broker_id"]
    db = str(tmp_path / "t.db")
    async with live_broker(raw, db) as live:
        warm = await until(lambda: len(ids := warm_ids(engine, broker_id)) == 2 and ids)
        record = await first_exec(live, "a", "cat notes.txt; echo $TANGRAM_ENVIRONMENT",
                                  files={"notes.txt": "from the client\n"})
        assert record["state"] == "succeeded", record
        env_id = record["result"]["environment"]
        assert record["result"]["stdout"] == f"from the client\n{env_id}\n"
        containers = {c.short_id: c.labels for c in labelled_containers(engine, broker_id)}
        _, env = await live.call("GET", f"/v1/environments/{env_id}")
        claimed = containers[env["sandbox"]["container"]]
        assert claimed[LABEL_ENV] in warm  # a warm sandbox became the trajectory's environment
        async def pool_full() -> bool:
            _, resources = await live.call("GET", "/v1/resources")
            [row] = [r for r in resources["resources"] if r["resource"] == "cpu"]
            return bool(row["warm_sandboxes"] == 2)

        await until(pool_full)  # the pool refills in the background
        assert len(warm_ids(engine, broker_id) - {claimed[LABEL_ENV]}) == 2
    # the stop kept the trajectory's sandbox (keep_sandboxes_on_stop) and removed the idle warm ones
    assert warm_ids(engine, broker_id) == {claimed[LABEL_ENV]}
    removing = {**raw, "cpu": {**raw["cpu"], "keep_sandboxes_on_stop": False}}
    async with live_broker(removing, db) as live:  # the next start adopts it under the environment's id
        again = await first_exec(live, "a", "cat notes.txt")
        assert again["state"] == "succeeded" and again["result"]["stdout"] == "from the client\n", again
        assert again["result"]["environment"] == env_id
    assert labelled_containers(engine, broker_id) == []


class CountingSandbox(Sandbox):
    """A sandbox that only remembers whether it was destroyed."""

    destroyed = False

    async def set_cores(self, cores: frozenset[int]) -> None:
        pass

    async def run(self, request: ExecRequest) -> ExecResult:
        return ExecResult()

    async def destroy(self) -> None:
        self.destroyed = True


def template() -> SandboxSpec:
    return SandboxSpec(env_id="warm", task="warm", trajectory=None, image="i", memory_mb=128, pids_limit=64)


async def test_the_pool_refills_what_is_claimed_and_fits_only_its_kind() -> None:
    made: list[SandboxSpec] = []
    sandboxes: list[CountingSandbox] = []

    async def create(spec: SandboxSpec) -> CountingSandbox:
        made.append(spec)
        sandboxes.append(CountingSandbox())
        return sandboxes[-1]

    pool = WarmPool(template(), 2, CreateRate(1000), create)
    pool.start()
    await until(lambda: len(pool) == 2)
    assert all(spec.warm and spec.env_id.startswith("warm-") and pool.owns(spec.env_id) for spec in made)
    other = SandboxSpec(env_id="e", task="t", trajectory="x", image="other", memory_mb=128, pids_limit=64)
    assert pool.claim(other) is None  # another image: a cold create
    mine = SandboxSpec(env_id="e", task="t", trajectory="x", image="i", memory_mb=128, pids_limit=64)
    claimed = pool.claim(mine)
    assert claimed is not None and len(pool) == 1
    await until(lambda: len(pool) == 2 and len(made) == 3)
    await pool.close()
    assert len(pool) == 0
    assert [sandbox.destroyed for sandbox in sandboxes] == [sandbox is not claimed for sandbox in sandboxes]


async def test_creates_queue_at_the_rate_instead_of_failing() -> None:
    rate = CreateRate(20)
    started = time.monotonic()
    stamps = []

    async def one() -> None:
        await rate.turn()
        stamps.append(time.monotonic() - started)

    await asyncio.gather(*(one() for _ in range(40)))
    stamps.sort()
    assert len(stamps) == 40
    assert stamps[19] < 0.5  # the first second's burst goes at once
    assert stamps[-1] >= 0.9  # the other 20 wait their turns, 1/20 s apart


async def test_a_pool_whose_creates_fail_keeps_trying_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sandboxes.warm_pool.REFILL_BACKOFF_S", 0.01)
    attempts = 0

    async def create(spec: SandboxSpec) -> CountingSandbox:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise SandboxError("engine_unavailable", "down")
        return CountingSandbox()

    pool: WarmPool[CountingSandbox] = WarmPool(template(), 1, CreateRate(1000), create)
    pool.start()
    await until(lambda: len(pool) == 1)
    assert attempts == 3
    await pool.close()
