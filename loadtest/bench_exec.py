"""Per-action overhead of ``exec`` on a real Docker engine, and the speed-up of an elastic pytest run.

Phase 1 runs the same short command many times, one at a time (empty queue), in one trajectory environment,
through two paths side by side on one engine:

* **fast path**: cgroup files written directly (cpuset, CPU quota, freezer) and the command sent to the executor
  inside the container over a bind-mounted unix socket;
* **docker-exec path**: ``docker update`` + ``docker unpause``/``pause`` + ``docker exec`` through the Engine API,
  what a broker without the fast path (or with a remote engine) pays;
* **agent path** (``--agent``): the node's agent, a Ray actor on a second Ray node of a cluster this benchmark starts
  on this machine, which runs the fast path on its node (issue 17): what a broker pays for a node on another host.
  ``--channels`` picks how the broker calls it (``[ray] channel``): ``auto`` (the unix socket of an agent on its
  host), ``tls`` (TLS over TCP, as to an agent on another host), ``ray`` (through Ray), one run each, in that order.

Overhead = the broker's ACT (submit to finish) minus the command's own run time measured inside the sandbox. CPU is
this process's (the broker, its client and, on the agent path, Ray's driver threads) per action: what a path costs
the broker's host, beside what it costs in time.

Phase 2 runs a real pytest suite (sleep-bound tests) with ``pytest -n {parallel_num}`` on 1 and on 2 cores.

    python -m loadtest.bench_exec [--engine unix:///var/run/docker.sock] [--actions 300] [--agent]
                                  [--channels auto,tls,ray]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import tempfile
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from loadtest.bench_scheduler import percentile
from tangram.config import parse_config
from tangram.service import running_broker


def config(engine: str, fast_path: bool, db: str, ray_address: str | None = None,
           channel: str = "auto") -> dict[str, Any]:
    """One node on ``engine``; with ``ray_address``, behind its agent on that Ray cluster, called by ``channel``."""
    node: dict[str, Any] = {"backend": "docker", "engine": engine, "cores": "0-1", "numa": ["0", "1"],
                            "memory_mb": 4096, "fast_path": fast_path}
    raw: dict[str, Any] = {"store": {"url": f"sqlite+aiosqlite:///{db}"},
                           "cpu": {"broker_id": f"bench-{uuid.uuid4().hex[:6]}", "nodes": {"n1": node}}}
    if ray_address is not None:
        node["agent"] = True
        raw["ray"] = {"address": ray_address, "channel": channel}
    return raw


async def with_broker(raw: dict[str, Any], body: Any) -> Any:
    async with running_broker(parse_config(raw)) as (_, app):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as http:
                return await body(http, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()


async def submit(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url + "/v1/actions?wait=true", json=body) as response:
        record = await response.json()
    if record.get("state") != "succeeded":
        raise RuntimeError(f"action did not succeed: {record}")
    return record


async def overhead(engine: str, fast_path: bool, count: int, ray_address: str | None = None,
                   channel: str = "auto") -> dict[str, float]:
    async def body(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
        action = {"task": "bench", "trajectory": "t", "kind": "exec", "demand": {"cpu": 1},
                  "spec": {"command": ["true"]}}
        await submit(http, url, action)  # creates the environment; not measured
        overheads, round_trips = [], []
        cpu_before = time.process_time()
        for _ in range(count):
            started = time.perf_counter()
            record = await submit(http, url, action)
            round_trips.append(time.perf_counter() - started)
            overheads.append(record["timings"]["act_s"] - record["result"]["duration_s"])
        return {"median_ms": statistics.median(overheads) * 1e3, "p99_ms": percentile(overheads, 0.99) * 1e3,
                "client_rtt_median_ms": statistics.median(round_trips) * 1e3,
                "cpu_ms": (time.process_time() - cpu_before) / count * 1e3}
    with tempfile.TemporaryDirectory() as tmp:
        return await with_broker(config(engine, fast_path, f"{tmp}/b.db", ray_address, channel), body)


def ray_cluster() -> Any:
    """A head and a second Ray node carrying node n1's resource, so n1's agent runs in another raylet; with Ray's
    token authentication and on 127.0.0.1 (``one_machine_cluster``), both set before Ray is imported (it reads them
    once per process)."""
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))  # the raylets and broker take it
    from managers.remote.broker.ray_loopback import keep_ray_on_loopback, one_machine_cluster

    keep_ray_on_loopback()  # before managers.remote.broker.ray_cluster imports Ray
    from managers.remote.broker.ray_cluster import node_resource

    small: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 << 20}
    return one_machine_cluster(small, {**small, "resources": {node_resource("n1"): 1}})


async def pytest_speedup(engine: str, tests: int, sleep_s: float) -> dict[int, float]:
    suite = "import time\n" + "".join(f"def test_{i}():\n    time.sleep({sleep_s})\n" for i in range(tests))

    async def body(http: aiohttp.ClientSession, url: str) -> dict[int, float]:
        times = {}
        for cores in (1, 2):
            action: dict[str, Any] = {"task": "bench", "trajectory": f"py{cores}", "kind": "exec",
                                      "demand": {"cpu": cores},
                      "spec": {"command": "pytest -q -p no:cacheprovider test_suite.py", "pytest_parallel": True}}
            # the environment, with the suite: files go with the action that makes it, never a later one's
            await submit(http, url, {**action, "spec": {"command": "true", "files": {"test_suite.py": suite}}})
            record = await submit(http, url, action)
            if record["result"]["exit_code"] != 0:
                raise RuntimeError(record["result"]["stdout"])
            times[cores] = record["result"]["duration_s"]
        return times
    with tempfile.TemporaryDirectory() as tmp:
        return await with_broker(config(engine, True, f"{tmp}/b.db"), body)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="unix:///var/run/docker.sock")
    parser.add_argument("--actions", type=int, default=300)
    parser.add_argument("--agent", action="store_true", help="also through the node's agent on a second Ray node")
    parser.add_argument("--channels", default="auto",
                        help="comma-separated: how the broker calls the agent, a run each (auto, tls, ray)")
    parser.add_argument("--tests", type=int, default=16, help="tests in the pytest suite (phase 2)")
    parser.add_argument("--sleep", type=float, default=0.25, help="seconds each test sleeps (phase 2)")
    args = parser.parse_args()
    channels = args.channels.split(",")
    if not set(channels) <= {"auto", "tls", "ray"}:
        parser.error(f"--channels: {args.channels!r}; each one of auto, tls, ray")
    print(f"phase 1: {args.actions} sequential `true` actions per path, engine {args.engine}")
    fast = await overhead(args.engine, True, args.actions)
    rows = [("fast (ours)", fast)]
    if args.agent:
        cluster = ray_cluster()
        try:
            for channel in channels:
                rows.append((f"agent, {channel}", await overhead(args.engine, True, args.actions, cluster.address,
                                                                 channel)))
        finally:
            import ray

            ray.shutdown()
            cluster.shutdown()
    slow = await overhead(args.engine, False, args.actions)
    rows.append(("docker-exec", slow))
    print(f"{'path':<18}{'median ms':>12}{'p99 ms':>10}{'client RTT ms':>15}{'CPU ms':>9}")
    for name, row in rows:
        print(f"{name:<18}{row['median_ms']:>12.2f}{row['p99_ms']:>10.2f}{row['client_rtt_median_ms']:>15.2f}"
              f"{row['cpu_ms']:>9.2f}")
    print(f"median overhead ratio docker-exec / fast: {slow['median_ms'] / fast['median_ms']:.1f}x")
    for name, row in rows[1:-1]:
        print(f"median overhead ratio {name} / fast: {row['median_ms'] / fast['median_ms']:.1f}x")
    print(f"phase 2: pytest -n {{parallel_num}} on {args.tests} tests of {args.sleep} s each")
    times = await pytest_speedup(args.engine, args.tests, args.sleep)
    print(f"1 core: {times[1]:.2f} s, 2 cores: {times[2]:.2f} s, speed-up {times[1] / times[2]:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
