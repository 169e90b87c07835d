"""The CPU manager's sandbox lifecycle metrics on a real Docker engine (issue 39), read from a live broker's
``/metrics``: a warm sandbox claimed and a new one made, one killed and found lost, the other adopted by the next
start; the sandboxes alive follow them."""

from __future__ import annotations

from typing import Any

from managers.cpu.environment import LossCause
from tests.docker_nodes import cpu_config, docker_engines, kill_sandbox
from tests.harness import Live, live_broker, until
from tests.scrape import scrape


def exec_body(trajectory: str) -> dict[str, Any]:
    return {"task": "t", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "true"}}


async def warm_pool_full(live: Live) -> bool:
    _, resources = await live.call("GET", "/v1/resources")
    [row] = [r for r in resources["resources"] if r["resource"] == "cpu"]
    return bool(row["warm_sandboxes"] == 1)


async def test_sandboxes_are_counted_as_they_are_made_lost_and_adopted(tmp_path) -> None:
    engine = docker_engines()[0]
    raw = cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 8192}},
                     default_memory_mb=128, warm_sandboxes=1, keep_sandboxes_on_stop=True)
    db = str(tmp_path / "t.db")
    async with live_broker(raw, db) as live:
        before = await scrape(live)
        await until(lambda: warm_pool_full(live))
        _, warm = await live.call("POST", "/v1/actions?wait=true", json=exec_body("warm"))
        assert warm["state"] == "succeeded", warm
        # a sandbox of another memory size than the warm pool's is made new
        status, new = await live.call("POST", "/v1/environments",
                                      json={"task": "t", "trajectory": "new", "memory_mb": 256})
        assert status == 201, new
        made = await scrape(live)
        kill_sandbox(engine, new["id"])
        _, told = await live.call("POST", "/v1/actions?wait=true", json=exec_body("new"))
        assert told["error"]["code"] == "environment_lost", told
        lost = await scrape(live)
    async with live_broker({**raw, "cpu": {**raw["cpu"], "keep_sandboxes_on_stop": False}}, db) as live:
        adopted = await scrape(live)

    for how in ("warm", "new"):  # a node's series are there from its start, at 0
        assert before.value("tangram_sandboxes_created_total", node="n1", how=how) == 0
    assert before.value("tangram_sandboxes_alive", node="n1") == 0
    assert before.value("tangram_sandboxes_lost_total", node="n1", reason=LossCause.SANDBOX_DIED) == 0

    assert made.value("tangram_sandboxes_created_total", node="n1", how="warm") == 1
    assert made.value("tangram_sandboxes_created_total", node="n1", how="new") == 1
    assert made.value("tangram_sandbox_create_seconds_count", node="n1") == 2
    assert made.value("tangram_sandboxes_alive", node="n1") == 2

    assert lost.value("tangram_sandboxes_lost_total", node="n1", reason=LossCause.SANDBOX_DIED) == 1
    assert lost.value("tangram_sandboxes_alive", node="n1") == 1

    # the stop kept the ready sandbox; the next start took it over, and has made none yet
    assert adopted.value("tangram_sandboxes_adopted_total", node="n1") == 1
    assert adopted.value("tangram_sandboxes_alive", node="n1") == 1
    assert adopted.value("tangram_sandboxes_created_total", node="n1", how="new") == 0
