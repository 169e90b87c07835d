"""What gVisor (``runsc``) costs a sandbox against the engine's default runtime (runc), measured side by side.

For each runtime, alternating, on the fast path of one local engine: a sandbox's creation, the per-action overhead
of ``true`` through the executor (the same ``Sandbox.execute`` the CPU manager calls), and a real PyPI project's
test suite on one core (``loadtest/suites.py``). Prints each round and the ratios runsc / runc.

The engine must know the runtime (``scripts/start-docker.sh`` registers ``runsc`` with ``--network=none`` and
``--host-uds=create``, without which its executor's socket is not reachable from the host)::

    python -m loadtest.bench_runtime --suite pyflakes --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import time
import uuid
from dataclasses import replace
from pathlib import Path

from loadtest.suites import DEFAULT_CACHE_DIR, SUITES, fetch
from sandboxes.backend import Sandbox, SandboxSpec
from sandboxes.docker import DockerBackend
from sandboxes.exec_wire import ExecRequest
from sandboxes.image import DEFAULT_IMAGE

RUNTIMES = ("runc", "runsc")


async def one_round(engine: str, runtime: str, suite: str, actions: int) -> dict[str, float]:
    """Creation, median per-action overhead and the suite's duration in one sandbox of ``runtime``."""
    fetched = fetch(next(s for s in SUITES if s.name == suite), DEFAULT_CACHE_DIR)
    backend = DockerBackend(engine, run_dir=Path("/run/tangram/bench-runtime"), cores=(0,), fast_path=True,
                            runtime=runtime)
    await backend.start()
    spec = SandboxSpec(env_id=f"bench-{runtime}-{uuid.uuid4().hex[:8]}", task="bench", trajectory="t",
                       image=DEFAULT_IMAGE, memory_mb=1024, pids_limit=256, broker_id="bench-runtime",
                       files={"suite.tar.gz": base64.b64decode(fetched.base64)})
    started = time.perf_counter()
    sandbox: Sandbox = await backend.create(spec)
    created_s = time.perf_counter() - started
    try:
        request = ExecRequest("true", cores=(0,), output_limit=4096, timeout_s=60, reap=True)
        for _ in range(10):  # warm
            await sandbox.execute("a", request)
        overheads = []
        for _ in range(actions):
            started = time.perf_counter()
            executed = await sandbox.execute("a", request)
            overheads.append(time.perf_counter() - started - executed.result.duration_s)
        unpack = replace(request, command="tar --no-same-owner -xzf suite.tar.gz", timeout_s=120)
        await sandbox.execute("a", unpack)
        test = replace(request, command=f"python3 -m pytest -q -p no:cacheprovider {fetched.suite.test_args}",
                       cwd=f"/workspace/{fetched.root}", timeout_s=600)
        started = time.perf_counter()
        executed = await sandbox.execute("a", test)
        suite_s = time.perf_counter() - started
        tail = executed.result.stdout.strip().splitlines()[-1:]
    finally:
        await sandbox.destroy()
        await backend.close()
    print(f"{runtime:>6}: create {created_s:.2f} s, overhead median {statistics.median(overheads) * 1e3:.2f} ms, "
          f"{suite} {suite_s:.2f} s ({tail[0] if tail else 'no output'})", flush=True)
    return {"create_s": created_s, "overhead_ms": statistics.median(overheads) * 1e3, "suite_s": suite_s}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="unix:///var/run/docker.sock")
    parser.add_argument("--suite", default="pyflakes", choices=[s.name for s in SUITES])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--actions", type=int, default=200, help="`true` actions per round for the overhead")
    args = parser.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {runtime: [] for runtime in RUNTIMES}
    for _ in range(args.rounds):
        for runtime in RUNTIMES:  # alternating, so that a noisy spell hits both
            rounds[runtime].append(await one_round(args.engine, runtime, args.suite, args.actions))
    for key in ("create_s", "overhead_ms", "suite_s"):
        ratios = [b[key] / a[key] for a, b in zip(rounds["runc"], rounds["runsc"], strict=True)]
        print(f"runsc / runc {key}: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-"
              f"{max(ratios):.2f} over {len(ratios)} rounds)")


if __name__ == "__main__":
    asyncio.run(main())
