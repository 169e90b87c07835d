"""REST throughput benchmark for ``lease`` actions against a real broker process (SQLite store unless ``--db``,
loopback HTTP).

Starts ``tangram serve`` in a subprocess, then submits leases one per request (many concurrent connections), one per
request waiting for each record's end (``?wait=true``) and in batches, and times each phase from the first submit
until every lease is granted (the queue is empty and the units are in use). All phases run against the same broker,
side by side. The Python client shares the machine's two cores with the broker; where Debian's ``wrk`` is installed,
it drives a second one-per-request phase.

Each phase also reports the broker's own CPU time per action (user + system of the broker process, from its
``/proc`` accounting): unlike throughput, it is not blurred by the load generator's share of the cores. It includes
the phase's polls of ``/v1/resources`` (one each 10 ms) and whatever the broker does in the background meanwhile.
Beside it, the bytes and calls the broker passed to ``write`` per action (its store's pages and its answers): an
exact count, where CPU time swings with whatever else the machine runs.

With ``--pin`` the broker runs on the last CPU this process may use and the load generator on the first, so that
neither takes the other's core: rounds of the same code on a small machine then swing less (they still swing). A
PostgreSQL server on the same machine is not pinned by this: pin it to the load generator's CPU beforehand
(``taskset -a -p 0x1 PID`` for each of its processes), or it takes the broker's core as well.

    python -m loadtest.bench_rest [--actions 20000] [--connections 64] [--batch 500] [--pin] [--db URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import psutil
from sqlalchemy.engine import make_url

CONFIG = """
[server]
port = {port}
[store]
url = "{db_url}"
[basic."lease.bench"]
concurrency = 10000000
lease_ttl_s = 3600.0
"""


def lease(i: int) -> dict[str, object]:
    return {"task": "bench", "kind": "lease", "demand": {"lease.bench": 1}, "spec": {"ttl_s": 3600}}


async def wait_granted(http: aiohttp.ClientSession, url: str, expected_in_use: int) -> None:
    while True:
        async with http.get(url + "/v1/resources") as response:
            body = orjson.loads(await response.read())
        row = next(r for r in body["resources"] if r["resource"] == "lease.bench")
        if row["in_use"] >= expected_in_use and body["stats"]["queued"] == 0:
            return
        await asyncio.sleep(0.01)


async def one_per_request(http: aiohttp.ClientSession, url: str, count: int, connections: int,
                          wait: bool = False) -> None:
    """``count`` submits, ``connections`` at a time; with ``wait``, each asks for the ended record
    (``?wait=true``), as a rollout that needs the result does."""
    counter = iter(range(count))
    target, expected = (url + "/v1/actions?wait=true", 200) if wait else (url + "/v1/actions", 201)

    async def worker() -> None:
        for i in counter:
            async with http.post(target, data=orjson.dumps(lease(i)),
                                 headers={"Content-Type": "application/json"}) as response:
                if response.status != expected:
                    raise RuntimeError(f"submit failed: {response.status} {await response.text()}")
                await response.read()

    await asyncio.gather(*(worker() for _ in range(connections)))


async def batched(http: aiohttp.ClientSession, url: str, count: int, batch: int, connections: int) -> None:
    batches = iter(range(0, count, batch))

    async def worker() -> None:
        for start in batches:
            body = orjson.dumps({"actions": [lease(i) for i in range(start, min(count, start + batch))]})
            async with http.post(url + "/v1/actions:batch", data=body,
                                 headers={"Content-Type": "application/json"}) as response:
                if response.status != 200:
                    raise RuntimeError(f"batch failed: {response.status} {await response.text()}")
                await response.read()

    await asyncio.gather(*(worker() for _ in range(connections)))


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{"task":"bench","kind":"lease","demand":{"lease.bench":1},"spec":{"ttl_s":3600}}'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  io.write(string.format("STATUS %d %d\\n", summary.requests, summary.errors.status))
end
"""


def run_wrk(url: str, connections: int, seconds: int) -> tuple[float, int]:
    """Submit leases with wrk (a C load generator): actions/s and how many were submitted."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_SCRIPT)
        script.flush()
        out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", script.name,
                              url + "/v1/actions"], capture_output=True, text=True, check=True).stdout
    rate_line = re.search(r"Requests/sec:\s+([\d.]+)", out)
    status_line = re.search(r"STATUS (\d+) (\d+)", out)
    if rate_line is None or status_line is None:
        raise SystemExit(f"wrk printed no rate or status line:\n{out}")
    rate = float(rate_line.group(1))
    requests, bad = map(int, status_line.groups())
    if bad:
        raise RuntimeError(f"wrk saw {bad} non-2xx responses")
    return rate, requests


@dataclass(frozen=True)
class Usage:
    """The broker process's CPU time so far (user + system), and the bytes and calls it passed to ``write``: its
    store's pages and its answers alike. The writes are counted exactly however busy the machine is, where the CPU
    time of the same run swings by a fifth."""

    cpu_s: float
    written: int
    writes: int

    @classmethod
    def of(cls, broker: psutil.Process) -> Usage:
        times, io = broker.cpu_times(), broker.io_counters()
        return cls(float(times.user + times.system), io.write_chars, io.write_count)

    def per_action(self, since: Usage, actions: int) -> str:
        """What each of ``actions`` cost from ``since`` to this, as the report says it."""
        return (f"{(self.cpu_s - since.cpu_s) / actions * 1e6:,.0f} us CPU, "
                f"{(self.written - since.written) / actions:,.0f} bytes in "
                f"{(self.writes - since.writes) / actions:.2f} writes each")


async def until_healthy(http: aiohttp.ClientSession, url: str) -> None:
    """Until the broker subprocess at ``url`` answers its health check (at most 30 s)."""
    for _ in range(300):
        try:
            async with http.get(url + "/healthz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            await asyncio.sleep(0.1)


async def bench(args: argparse.Namespace, url: str, broker: psutil.Process) -> None:
    connector = aiohttp.TCPConnector(limit=args.connections)
    async with aiohttp.ClientSession(connector=connector) as http:
        await until_healthy(http, url)
        await one_per_request(http, url, 500, args.connections)  # warm-up
        await wait_granted(http, url, 500)
        granted = 500
        started, before = time.perf_counter(), Usage.of(broker)
        await one_per_request(http, url, args.actions, args.connections)
        await wait_granted(http, url, granted + args.actions)
        single = args.actions / (time.perf_counter() - started)
        single_cost = Usage.of(broker).per_action(before, args.actions)
        granted += args.actions
        started, before = time.perf_counter(), Usage.of(broker)
        await one_per_request(http, url, args.actions, args.connections, wait=True)
        waited = args.actions / (time.perf_counter() - started)
        waited_cost = Usage.of(broker).per_action(before, args.actions)
        granted += args.actions
        wrk = None
        if shutil.which("wrk"):
            before = Usage.of(broker)
            wrk, submitted = run_wrk(url, args.connections, args.wrk_seconds)
            granted += submitted
            await wait_granted(http, url, granted)
            wrk_cost = Usage.of(broker).per_action(before, submitted)
        started, before = time.perf_counter(), Usage.of(broker)
        await batched(http, url, args.actions, args.batch, max(1, min(4, args.connections)))
        await wait_granted(http, url, granted + args.actions)
        many = args.actions / (time.perf_counter() - started)
        many_cost = Usage.of(broker).per_action(before, args.actions)
    print(f"REST throughput, lease actions, {args.actions} per phase, {store_name(args.db)} store, loopback HTTP "
          f"(the broker process's CPU, user + system, and its writes per action"
          f"{'; broker and load generator pinned to one CPU each' if args.pin else ''})")
    print(f"  one per request ({args.connections} connections, Python client): {single:,.0f} actions/s, "
          f"{single_cost}")
    print(f"  one per request, ?wait=true ({args.connections} connections):     {waited:,.0f} actions/s, "
          f"{waited_cost}")
    if wrk is not None:
        print(f"  one per request ({args.connections} connections, wrk):           {wrk:,.0f} actions/s, "
              f"{wrk_cost}")
    print(f"  batched ({args.batch} per request, Python client):             {many:,.0f} actions/s, "
          f"{many_cost}")


def store_name(url: str | None) -> str:
    """The database a ``--db`` URL names, as the report says it (none: the default SQLite file)."""
    backend = "sqlite" if url is None else make_url(url).get_backend_name()
    return {"sqlite": "SQLite", "postgresql": "PostgreSQL"}.get(backend, backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actions", type=int, default=20000)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--wrk-seconds", type=int, default=8)
    parser.add_argument("--db", help="store URL (default: a fresh SQLite file)")
    parser.add_argument("--pin", action="store_true", help="the broker on one CPU, this load generator on another")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 2:
        parser.error(f"--pin needs two CPUs; this process may use {cpus}")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "bench.toml"
        config.write_text(CONFIG.format(port=args.port, db_url=args.db or f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"))
        if args.pin:  # the broker inherits this, and every thread it starts inherits it from the broker
            os.sched_setaffinity(0, {cpus[-1]})
        server = subprocess.Popen([sys.executable, "-m", "tangram.cli", "serve", "--config", str(config)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if args.pin:  # this load generator, and wrk after it, on another CPU
            os.sched_setaffinity(0, {cpus[0]})
        try:
            asyncio.run(bench(args, f"http://127.0.0.1:{args.port}", psutil.Process(server.pid)))
        finally:
            server.terminate()
            _, err = server.communicate(timeout=30)
            if server.returncode not in (0, -15):
                print(err.decode()[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
