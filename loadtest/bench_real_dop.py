"""Real mode: elastic (malleable) test runs against fixed DoP 1 and 2, on this machine's Docker engine.

One time-compressed AI-coding trace (``tangram.sim.replay``: tool calls burn CPU on one core, test runs fork one
burner per worker for their share of the work) is replayed against a fresh broker per run: a Docker node on
``--cores``, SQLite, the service's defaults. Policies run in rotated order (A B C, B C A, C A B, ...) so that load
from elsewhere on this noisy machine falls on each alike; each policy's figure is the median over its runs.

    python -m loadtest.bench_real_dop [--rounds 3] [--batch 6] [--compress 20] [--seed 1] [--cores 0-1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from tangram.config import parse_config
from tangram.service import running_broker
from tangram.sim.replay import build_trace, replay
from tangram.sim.trace import Trace

#: policy name -> the fixed DoP its test runs ask for (None: elastic, 1..node size, malleable)
POLICIES: dict[str, int | None] = {"tangram": None, "dop1": 1, "dop2": 2}


def broker_config(cores: str, db: Path, engine: str) -> dict[str, Any]:
    return {"store": {"url": f"sqlite+aiosqlite:///{db}"}, "gpu": {"enabled": False},
            "cpu": {"broker_id": f"bench-{uuid.uuid4().hex[:8]}", "default_memory_mb": 256,
                    "nodes": {"n1": {"backend": "docker", "engine": engine, "cores": cores, "memory_mb": 8192}}}}


async def one_run(trace: Trace, policy: str, cores: str, engine: str) -> dict[str, Any]:
    """A fresh broker on a free loopback port, the whole trace replayed against it, its summary."""
    with tempfile.TemporaryDirectory() as directory:
        config = parse_config(broker_config(cores, Path(directory) / "bench.db", engine))
        async with running_broker(config) as (_, app):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            try:
                port = runner.addresses[0][1]
                result = await replay(trace, f"http://127.0.0.1:{port}", fixed_dop=POLICIES[policy])
            finally:
                await runner.cleanup()
    return result.summary()


async def bench(rounds: int, batch: int, compress: float, seed: int, cores: str, engine: str) -> int:
    trace = build_trace(batch, compress, seed, memory_mb=256)
    names = list(POLICIES)
    acts: dict[str, list[float]] = {name: [] for name in names}
    print(f"trace: ai_coding batch={batch} seed={seed} compressed x{compress:g}: {trace.calls} calls; "
          f"Docker node on cores {cores}; {rounds} rounds in rotated order", flush=True)
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            summary = await one_run(trace, name, cores, engine)
            if summary["failed_calls"]:
                print(f"{name}: {summary['failed_calls']} calls failed", flush=True)
                return 1
            test = summary["by_kind"].get("test", {})
            acts[name].append(summary["mean_trajectory_act_s"])
            print(f"round {round_index + 1} {name:>8}: mean ACT per trajectory {summary['mean_trajectory_act_s']:.3f} s, "
                  f"test runs {test.get('mean_act_s', 0.0):.3f} s on {test.get('mean_units', 0.0):.2f} cores, "
                  f"tool queueing {summary['by_kind']['tool']['mean_queue_s'] * 1e3:.1f} ms", flush=True)
    medians = {name: statistics.median(values) for name, values in acts.items()}
    best = min((name for name in names if name != "tangram"), key=medians.__getitem__)
    print("median mean ACT per trajectory: " + ", ".join(f"{n} {v:.3f} s" for n, v in medians.items()))
    print(f"best fixed ({best}) / tangram: {medians[best] / medians['tangram']:.3f}  "
          f"(range over rounds: tangram {min(acts['tangram']):.3f}-{max(acts['tangram']):.3f} s, "
          f"{best} {min(acts[best]):.3f}-{max(acts[best]):.3f} s)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_real_dop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--compress", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cores", default="0-1")
    parser.add_argument("--engine", default="unix:///var/run/docker.sock")
    args = parser.parse_args()
    return asyncio.run(bench(args.rounds, args.batch, args.compress, args.seed, args.cores, args.engine))


if __name__ == "__main__":
    raise SystemExit(main())
