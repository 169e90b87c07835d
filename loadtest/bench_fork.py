"""Forking a prepared environment (issue 38's target: N = 8 of a sandbox with 200 MB written, in 2 s) against the
two ways without it, measured in the same run on a real Docker engine:

* **fork**: ``POST /v1/environments/{id}/fork?n=8``, the source's 200 MB written once into a snapshot image;
* **create + copy**: 8 ``POST /v1/environments`` and the source's files ``PUT`` into each (a tar per 10 MiB
  file, as one write is capped at 16 MiB), the 8 concurrently;
* **create + build**: 8 ``POST /v1/environments`` and the same writes run again in each, concurrently.

Each figure is a client's wall time until all 8 are ready with the files, printed with its ratio to create + copy.

    python -m loadtest.bench_fork [--engine unix:///var/run/docker.sock] [--n 8] [--mb 200] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import tarfile
import tempfile
import time
from typing import Any

import aiohttp

from loadtest.bench_exec import config, submit, with_broker

TASK = "bench"
MEMORY_MB = 512


async def create(http: aiohttp.ClientSession, url: str, trajectory: str) -> str:
    async with http.post(f"{url}/v1/environments", json={"task": TASK, "trajectory": trajectory,
                                                         "memory_mb": MEMORY_MB}) as response:
        assert response.status == 201, await response.text()
        return str((await response.json())["id"])


def files(mb: int) -> int:
    return max(1, mb // 10)


def build(mb: int) -> str:
    """The files a prepared environment has: ``mb`` MiB in files of 10 MiB."""
    return f"mkdir -p deps && for i in $(seq {files(mb)}); do head -c 10M /dev/urandom > deps/f$i; done"


async def tar_of(http: aiohttp.ClientSession, url: str, env: str, path: str) -> bytes:
    """One file of ``env`` as a tar to ``PUT`` elsewhere: one per request, as a write is capped at ``[cpu.limits]
    max_files_bytes`` (16 MiB by default)."""
    async with http.get(f"{url}/v1/environments/{env}/files", params={"path": path}) as response:
        assert response.status == 200, await response.text()
        data = await response.read()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(path)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def build_in(http: aiohttp.ClientSession, url: str, env: str, mb: int) -> None:
    await submit(http, url, {"task": TASK, "kind": "exec", "demand": {"cpu": 1},
                             "spec": {"command": build(mb), "environment": env}})


async def copy(http: aiohttp.ClientSession, url: str, trajectory: str, tars: list[bytes]) -> str:
    env = await create(http, url, trajectory)
    for tar in tars:
        async with http.put(f"{url}/v1/environments/{env}/files", data=tar,
                            headers={"Content-Type": "application/x-tar"}) as response:
            assert response.status == 200, await response.text()
    return env


async def rebuild(http: aiohttp.ClientSession, url: str, trajectory: str, mb: int) -> str:
    env = await create(http, url, trajectory)
    await build_in(http, url, env, mb)
    return env


async def delete(http: aiohttp.ClientSession, url: str, envs: list[str]) -> None:
    for env in envs:
        async with http.delete(f"{url}/v1/environments/{env}") as response:
            assert response.status == 200, await response.text()


async def rounds(engine: str, n: int, mb: int, count: int) -> dict[str, list[float]]:
    async def measure(http: aiohttp.ClientSession, url: str) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"fork": [], "create + copy": [], "create + build": []}
        for r in range(count):
            source = await create(http, url, f"source-{r}")
            await build_in(http, url, source, mb)
            tars = [await tar_of(http, url, source, f"deps/f{i}") for i in range(1, files(mb) + 1)]

            started = time.perf_counter()
            async with http.post(f"{url}/v1/environments/{source}/fork", params={"n": str(n)},
                                 json={"trajectories": [f"fork-{r}-{i}" for i in range(n)]}) as response:
                assert response.status == 201, await response.text()
                forks = [env["id"] for env in (await response.json())["environments"]]
            times["fork"].append(time.perf_counter() - started)
            await delete(http, url, forks)

            started = time.perf_counter()
            copies = await asyncio.gather(*(copy(http, url, f"copy-{r}-{i}", tars) for i in range(n)))
            times["create + copy"].append(time.perf_counter() - started)
            await delete(http, url, copies)

            started = time.perf_counter()
            built = await asyncio.gather(*(rebuild(http, url, f"build-{r}-{i}", mb) for i in range(n)))
            times["create + build"].append(time.perf_counter() - started)
            await delete(http, url, [*built, source])
        return times

    with tempfile.TemporaryDirectory() as tmp:
        raw = config(engine, True, f"{tmp}/bench.db")
        size = (mb + 16) << 20
        raw["cpu"]["nodes"]["n1"]["memory_mb"] = MEMORY_MB * (2 * n + 1)
        raw["cpu"]["limits"] = {"max_files_bytes": size, "max_fork": max(n, 1)}
        raw["server"] = {"max_body_bytes": size}
        result: dict[str, list[float]] = await with_broker(raw, measure)
        return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="unix:///var/run/docker.sock")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    times = await rounds(args.engine, args.n, args.mb, args.rounds)
    baseline = min(times["create + copy"])
    print(f"{args.n} environments with {args.mb} MiB written, {args.rounds} round(s) on {args.engine} (fast path)")
    for name, values in times.items():
        row: dict[str, Any] = {"best_s": round(min(values), 2), "worst_s": round(max(values), 2),
                               "best / create + copy": round(min(values) / baseline, 2)}
        print(f"  {name:15s} {row}")


if __name__ == "__main__":
    asyncio.run(main())
