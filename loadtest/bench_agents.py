"""REST and scheduling with 20 node agents (issue 17): how many exec actions a second one broker carries when its
nodes are behind agents.

The broker runs in a subprocess (``--serve``) with 20 CPU nodes of 256 cores, each behind a real ``NodeAgent``
driven through ``AgentBackend``, the classes a Ray actor and the broker use; only the transport and the sandboxes
are stand-ins: each agent call is a pickle round trip of its arguments and reply in the broker's process (no Ray
hop: `bench_exec --agent` measures that), and each sandbox answers a command at once. So the figure is the
broker's own cost per action through the agent protocol: REST, the store, the scheduling passes, the CPU manager's
environments and the agent calls (create, execute, destroy for a one-action sandbox).

The client submits ``--actions`` exec actions in batches of ``--batch`` over 4 connections and times from the first
submit until the broker's queue and running set are empty.

    python -m loadtest.bench_agents [--actions 20000] [--batch 500] [--trajectories 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from aiohttp import web

from loadtest.bench_rest import until_healthy
from managers.cpu.config import CpuConfig, CpuNodeConfig
from managers.cpu.manager import CpuManager
from managers.remote.broker.agent_backend import AgentBackend
from managers.remote.node.node_agent import NodeAgent
from managers.remote.replies import Reply
from sandboxes.backend import Leftover, NodeHardware, Sandbox, SandboxBackend, SandboxSpec
from sandboxes.exec_wire import ExecRequest, ExecResult
from tangram.config import parse_config
from tangram.service import running_broker

NODES, CORES = 20, 256


class InstantSandbox(Sandbox):
    """A sandbox whose commands end at once."""

    async def set_cores(self, cores: frozenset[int]) -> None:
        pass

    async def run(self, request: ExecRequest) -> ExecResult:
        return ExecResult(exit_code=0)

    async def destroy(self) -> None:
        pass


class InstantSandboxes(SandboxBackend):
    kind = "instant"

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return InstantSandbox()

    async def adopt(self, broker_id: str) -> list[Leftover]:
        return []

    async def reap(self, broker_id: str) -> int:
        return 0


async def agent_backend(node: CpuNodeConfig, config: CpuConfig) -> SandboxBackend:
    """Node ``node`` behind a real NodeAgent, its calls' arguments and replies pickled as a transport would."""
    async def opened() -> SandboxBackend:
        return InstantSandboxes()

    agent = NodeAgent(opened, config.limits, NodeHardware(tuple(range(CORES)), 1 << 20, (tuple(range(CORES)),)))

    async def call(method: str, *args: Any) -> Reply:
        reply: Reply = await getattr(agent, method)(*pickle.loads(pickle.dumps(args)))
        received: Reply = pickle.loads(pickle.dumps(reply))
        return received

    async def release() -> None:
        pass

    backend = AgentBackend(call, node.name, release)
    await backend.start()
    return backend


def broker_config(port: int, db: str) -> dict[str, Any]:
    nodes = {f"n{i}": {"backend": "local", "unsandboxed": True, "cores": f"0-{CORES - 1}", "memory_mb": 1 << 20}
             for i in range(NODES)}
    return {"server": {"port": port, "max_batch": 2000}, "store": {"url": f"sqlite+aiosqlite:///{db}"},
            "cpu": {"nodes": nodes, "default_memory_mb": 64, "max_environments": 1_000_000}}


async def serve(port: int, db: str) -> None:
    config = parse_config(broker_config(port, db))
    async with running_broker(config, [CpuManager(config.cpu, agent_backend)]) as (_, app):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()


def exec_action(i: int, trajectories: int) -> dict[str, Any]:
    return {"task": "bench", "trajectory": f"t{i % trajectories}", "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": ["true"]}}


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/v1/resources") as response:
        body: dict[str, Any] = (await response.json())["stats"]
    return body


async def finished(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Actions that ended, by state, from the broker's /metrics."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tangram_actions_finished_total{"):
            state = line.split('state="', 1)[1].split('"', 1)[0]
            counts[state] = counts.get(state, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


async def drive(url: str, actions: int, batch: int, trajectories: int) -> tuple[float, dict[str, float]]:
    async with aiohttp.ClientSession() as http:
        await until_healthy(http, url)
        batches = iter(range(0, actions, batch))
        started = time.perf_counter()

        async def worker() -> None:
            for start in batches:
                body = {"actions": [exec_action(i, trajectories) for i in range(start, min(actions, start + batch))]}
                async with http.post(url + "/v1/actions:batch", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as response:
                    if response.status != 200:
                        raise RuntimeError(f"batch failed: {response.status} {await response.text()}")

        await asyncio.gather(*(worker() for _ in range(4)))
        while (now := await stats(http, url))["queued"] or now["running"]:
            await asyncio.sleep(0.05)
        return actions / (time.perf_counter() - started), await finished(http, url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actions", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--trajectories", type=int, default=2000, help="environments the actions run in")
    parser.add_argument("--port", type=int, default=18310)
    parser.add_argument("--serve", metavar="DB", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve(args.port, args.serve))
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen([sys.executable, "-m", "loadtest.bench_agents", "--serve", str(Path(tmp) / "b.db"),
                                   "--port", str(args.port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rate, ended = asyncio.run(drive(f"http://127.0.0.1:{args.port}", args.actions, args.batch,
                                            args.trajectories))
        finally:
            server.terminate()
            _, err = server.communicate(timeout=60)
            if server.returncode not in (0, -15):
                print(err.decode()[-2000:], file=sys.stderr)
        print(f"{NODES} nodes x {CORES} cores behind node agents (in-process transport, instant sandboxes): "
              f"{args.actions} exec actions over {args.trajectories} trajectories, batches of {args.batch}: "
              f"{rate:,.0f} actions/s; ended: {', '.join(f'{n:.0f} {s}' for s, n in sorted(ended.items()))}")


if __name__ == "__main__":
    main()
