"""The README's example rollout, run as a user would (a subprocess) against a real broker with Docker sandboxes."""

from __future__ import annotations

import asyncio
import os
import sys

from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import live_broker


async def test_example_rollout_runs_every_trajectory_and_cleans_up(tmp_path):
    config = {"basic": {"lease.local": {"concurrency": 4}},
              **cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1",
                                   "memory_mb": 2048}})}
    async with live_broker(config, str(tmp_path / "t.db")) as live:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tangram_client.examples.rollout", "--url", live.url, "--trajectories", "3",
            "--think-s", "0.1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"})
        output, _ = await asyncio.wait_for(process.communicate(), timeout=240)
        text = output.decode()
        assert process.returncode == 0, text
        rows = [line for line in text.splitlines() if "traj-" in line]
        assert len(rows) == 3 and all("│ 1.0    │ 4 " in row for row in rows), text  # reward 1, four actions each
        assert "mean reward 1.00" in text and f"{live.url}/ui" in text
        sample = live.broker.metrics.registry.get_sample_value
        for kind, count in (("exec", 12), ("lease", 6)):
            labels = {"kind": kind, "task": "example-rollout", "state": "succeeded", "error": ""}
            assert sample("tangram_actions_finished_total", labels) == count
        status, body = await live.call("GET", "/v1/environments?task=example-rollout")
        assert status == 200 and body["environments"] == []  # every trajectory deleted its sandbox
