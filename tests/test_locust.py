"""The load test in loadtest/ as a test: a short headless locust run of the agentic mix (coding, search and lease
trajectories) against a real broker built from loadtest/broker.toml, with sandboxes on the real Docker engine, the
real MiniLM reward model on CPU virtual GPUs and the search upstream on loopback, with auth on as every shipped
config has it (locust sends the task's token). It must end with zero failures, every kind of action exercised, and the
broker's own counters agreeing with what locust sent."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tomllib
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from loadtest.upstream import search_app
from tangram.server.auth import new_token, token_sha256
from tests.docker_nodes import cpu_config, docker_engines, labelled_containers
from tests.harness import Live, live_broker

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reward model comes from a Python package

ROOT = Path(__file__).resolve().parents[1]
TASK = "locust-ci"
ADMIN, TOKEN = new_token(), new_token()
KINDS = ("exec", "reward", "api", "lease")
# a short run: 5 users (2 coding, 2 search, 1 lease), think times a tenth of an LLM's, 20 s of new trajectories
SETTINGS = {"LOADTEST_TASK": TASK, "LOADTEST_MIX": "coding=2,search=2,lease=1", "LOADTEST_THINK_SCALE": "0.1",
            "LOADTEST_SHELL_STEPS": "3", "LOADTEST_TIMEOUT_S": "60", "LOADTEST_TOKEN": TOKEN}
LOCUST_ARGS = ["--headless", "--users", "5", "--spawn-rate", "5", "--run-time", "20s", "--stop-timeout", "60",
               "--only-summary"]


def broker_config(engine: str, upstream_url: str) -> dict[str, Any]:
    """loadtest/broker.toml, with its sandbox node on the test's Docker engine, its API on the test's upstream, and
    auth on: an admin token and the task's."""
    raw = tomllib.loads((ROOT / "loadtest" / "broker.toml").read_text())
    raw["basic"]["api.search"]["upstream"]["base_url"] = upstream_url
    node = {"backend": "docker", "engine": engine, "cores": "0-1", "numa": ["0-1"], "memory_mb": 4096}
    raw["cpu"] = {**raw["cpu"], **cpu_config({"n1": node})["cpu"]}
    raw["auth"] = {"admin_token_sha256": token_sha256(ADMIN)}
    raw.setdefault("tasks", {}).setdefault(TASK, {})["token_sha256"] = token_sha256(TOKEN)
    return raw


@asynccontextmanager
async def search_upstream() -> AsyncIterator[str]:
    server = TestServer(search_app(delay_s=0.02), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def run_locust(host: str, stats_prefix: Path) -> tuple[int, str]:
    """Locust in a subprocess (it is gevent-based); this test's event loop keeps serving the broker meanwhile."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), *LOCUST_ARGS,
        "--host", host, "--json-file", str(stats_prefix), cwd=ROOT, env={**os.environ, **SETTINGS},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await process.communicate()
    return process.returncode or 0, output.decode(errors="replace")


async def finished_by_kind_and_state(live: Live) -> Counter[tuple[str, str]]:
    _, text = await live.call("GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    counts: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tangram_actions_finished_total" and sample.labels["task"] == TASK:
                counts[sample.labels["kind"], sample.labels["state"]] += int(sample.value)
    return counts


async def test_short_headless_run_of_the_agentic_mix_has_no_failures_and_the_broker_agrees(tmp_path: Path) -> None:
    engine = docker_engines()[0]
    async with search_upstream() as upstream_url:
        config = broker_config(engine, upstream_url)
        async with live_broker(config, str(tmp_path / "tangram.db")) as live:
            code, output = await run_locust(live.url, tmp_path / "stats")
            assert code == 0, output[-6000:]

            rows = json.loads((tmp_path / "stats.json").read_text())
            requests = {row["name"]: row["num_requests"] for row in rows}
            assert sum(row["num_failures"] for row in rows) == 0, output[-6000:]
            actions = Counter({kind: sum(n for name, n in requests.items() if name.split()[0] == kind)
                               for kind in KINDS})
            assert all(actions[kind] > 0 for kind in KINDS), requests
            # every coding trajectory that ran its tests deleted its sandbox; every lease was given back
            assert requests.get("exec tests", 0) > 0
            assert requests.get("DELETE environment") == requests["exec tests"]
            assert requests.get("DELETE lease") == requests["lease"]

            # the broker saw exactly these actions, and every one of them succeeded
            finished = await finished_by_kind_and_state(live)
            assert finished == Counter({(kind, "succeeded"): actions[kind] for kind in KINDS})
            _, environments = await live.call("GET", f"/v1/environments?task={TASK}",
                                              headers={"Authorization": f"Bearer {TOKEN}"})
            assert environments["environments"] == []
            assert labelled_containers(engine, config["cpu"]["broker_id"]) == []
            _, resources = await live.call("GET", "/v1/resources", headers={"Authorization": f"Bearer {ADMIN}"})
            assert resources["stats"]["leases"] == 0 and resources["stats"]["running"] == 0
