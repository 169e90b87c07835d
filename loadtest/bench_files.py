"""The time of a 1 MiB file write and read through ``/v1/environments/{id}/files`` on a real Docker engine (issue
38's target: 20 ms p50 each on the fast path), against the cheapest exec action in the same environment (``true``,
submitted and waited for), measured in the same run, alternating: exec, write, read, exec, write, read...

Each figure is a client's wall time for one HTTP request on loopback, the broker and the sandbox's executor on this
machine: the write is a JSON body (base64) the broker decodes and checks, then sends raw to the executor (after its
frame's JSON), which writes it atomically; the read comes back raw from the executor and as raw bytes. The write's
body is serialised in each request with orjson, as ``tangram_client`` does (the file's base64 is made once, before).

    python -m loadtest.bench_files [--engine unix:///var/run/docker.sock] [--rounds 200] [--size 1048576]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import tempfile
import time
from typing import Any

import aiohttp
import orjson

from loadtest.bench_exec import config, with_broker
from loadtest.bench_scheduler import percentile

JSON = {"Content-Type": "application/json"}


async def rounds(engine: str, count: int, size: int) -> dict[str, list[float]]:
    blob = os.urandom(size)
    body = {"files": {"blob.bin": {"base64": base64.b64encode(blob).decode()}}}

    async def measure(http: aiohttp.ClientSession, url: str) -> dict[str, list[float]]:
        async with http.post(f"{url}/v1/environments", json={"task": "bench", "memory_mb": 512}) as response:
            env = (await response.json())["id"]
        files = f"{url}/v1/environments/{env}/files"
        exec_body = {"task": "bench", "kind": "exec", "demand": {"cpu": 1},
                     "spec": {"command": "true", "environment": env}}
        times: dict[str, list[float]] = {"exec true": [], "write": [], "read": []}
        for i in range(count + 5):  # the first five warm up
            started = time.perf_counter()
            async with http.post(f"{url}/v1/actions?wait=true", json=exec_body) as response:
                assert (await response.json())["state"] == "succeeded"
            exec_s = time.perf_counter() - started
            started = time.perf_counter()
            async with http.put(files, data=orjson.dumps(body), headers=JSON) as response:
                assert response.status == 200, await response.text()
            write_s = time.perf_counter() - started
            started = time.perf_counter()
            async with http.get(files, params={"path": "blob.bin"}) as response:
                assert await response.read() == blob
            read_s = time.perf_counter() - started
            if i >= 5:
                for name, seconds in (("exec true", exec_s), ("write", write_s), ("read", read_s)):
                    times[name].append(seconds * 1000)
        return times

    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, list[float]] = await with_broker(config(engine, True, f"{tmp}/bench.db"), measure)
        return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="unix:///var/run/docker.sock")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--size", type=int, default=1 << 20)
    args = parser.parse_args()
    times = await rounds(args.engine, args.rounds, args.size)
    baseline = percentile(times["exec true"], 0.5)
    print(f"{args.rounds} rounds of {args.size} bytes on {args.engine} (fast path), alternating")
    for name, values in times.items():
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        row: dict[str, Any] = {"p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "p50 / exec true": round(
            p50 / baseline, 2)}
        print(f"  {name:10s} {row}")


if __name__ == "__main__":
    asyncio.run(main())
