"""A new trajectory's first exec, with and without warm sandboxes (issue 17), on the real Docker engines.

Phase 1 starts new trajectories one after another (one ``true`` each) on a broker whose node keeps no warm
sandbox (cold: the first exec creates the container and waits for its executor) and on one whose node keeps
``--pool`` (warm: the first exec claims one), in alternating rounds; between rounds the warm pool refills. The
figure is the first exec's overhead, the broker's ACT minus the command's own run time: from submit to the command
running and back.

Phase 2 submits a burst of ``--burst`` new trajectories at once over the engines (a node each), warm pools on,
creates limited to ``--rate`` per second per node: none may fail, and the time until all ran is printed.

    python -m loadtest.bench_warm [--rounds 3] [--per-round 8] [--pool 8] [--burst 200] [--rate 10] [--engines A,B]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from typing import Any

import aiohttp

from loadtest.bench_exec import submit, with_broker
from loadtest.bench_scheduler import percentile


def config(engines: list[str], pool: int, rate: float, db: str) -> dict[str, Any]:
    nodes = {f"n{i}": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 16384}
             for i, engine in enumerate(engines)}
    return {"store": {"url": f"sqlite+aiosqlite:///{db}"},
            "cpu": {"broker_id": f"bench-{uuid.uuid4().hex[:6]}", "nodes": nodes, "default_memory_mb": 64,
                    "warm_sandboxes": pool, "creates_per_s": rate}}


def first_exec(trajectory: str) -> dict[str, Any]:
    return {"task": "bench", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": ["true"]}}


async def warm_count(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/v1/resources") as response:
        rows = (await response.json())["resources"]
    return sum(row.get("warm_sandboxes", 0) for row in rows if row["resource"] == "cpu")


async def first_execs(engine: str, pool: int, count: int) -> list[float]:
    """Overheads (s) of ``count`` new trajectories' first execs, one after another, once the pool is full."""
    async def body(http: aiohttp.ClientSession, url: str) -> list[float]:
        while await warm_count(http, url) < pool:
            await asyncio.sleep(0.1)
        overheads = []
        for i in range(count):
            record = await submit(http, url, first_exec(f"t{i}"))
            overheads.append(record["timings"]["act_s"] - record["result"]["duration_s"])
        return overheads
    with tempfile.TemporaryDirectory() as tmp:
        overheads: list[float] = await with_broker(config([engine], pool, 10.0, f"{tmp}/b.db"), body)
    return overheads


async def burst(engines: list[str], count: int, rate: float) -> tuple[int, float]:
    """Failures and seconds until ``count`` new trajectories' first execs, submitted at once, all ended."""
    async def body(http: aiohttp.ClientSession, url: str) -> tuple[int, float]:
        started = time.perf_counter()

        async def one(i: int) -> bool:
            async with http.post(url + "/v1/actions?wait=true", json=first_exec(f"b{i}")) as response:
                return (await response.json()).get("state") == "succeeded"

        results = await asyncio.gather(*(one(i) for i in range(count)))
        return sum(not ok for ok in results), time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        outcome: tuple[int, float] = await with_broker(config(engines, 4, rate, f"{tmp}/b.db"), body)
    return outcome


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1e3:8.1f} ms, p99 {percentile(values, 0.99) * 1e3:8.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=8)
    parser.add_argument("--pool", type=int, default=8)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--engines", default=os.environ.get("TANGRAM_TEST_DOCKER_NODES", "unix:///var/run/docker.sock"),
                        help="comma-separated Docker engines, one node each (default: the test engines)")
    args = parser.parse_args()
    engines = args.engines.split(",")
    cold: list[float] = []
    warm: list[float] = []
    print(f"phase 1: {args.rounds} rounds of {args.per_round} new trajectories, cold then warm (pool {args.pool})")
    for round_ in range(args.rounds):
        cold_round = await first_execs(engines[0], 0, args.per_round)
        warm_round = await first_execs(engines[0], args.pool, args.per_round)
        cold += cold_round
        warm += warm_round
        print(f"  round {round_ + 1}: cold {summary(cold_round)} | warm {summary(warm_round)}")
    print(f"first exec, cold: {summary(cold)}")
    print(f"first exec, warm: {summary(warm)}")
    print(f"median ratio cold / warm: {statistics.median(cold) / statistics.median(warm):.1f}x")
    if args.burst:
        failed, seconds = await burst(engines, args.burst, args.rate)
        print(f"phase 2: {args.burst} new trajectories at once on {len(engines)} nodes, {args.rate:g} creates/s "
              f"per node: {failed} failed, all ended in {seconds:.1f} s")


if __name__ == "__main__":
    asyncio.run(main())
