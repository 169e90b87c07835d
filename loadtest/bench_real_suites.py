"""Real suites: real pytest suites of PyPI projects as trajectories' test runs, elastic against fixed DoP 1 and 2.

``bench_real_dop`` burns CPU for a trace's durations; here the work is real: each trajectory unpacks a pinned sdist
(``loadtest.suites``) in its sandbox, makes a few short tool calls with think time between them, and ends with the
project's own test suite as one ``exec``. Policies differ only in that last action: ``tangram`` asks for 1-2 cores,
malleable, with ``pytest_parallel`` and a declared elasticity; ``dop1`` for one core and plain pytest; ``dop2`` for
two cores and ``pytest -n 2``. The declared ``t1`` is each suite's single-core time from a profiling pass the bench
runs first (the paper profiles in advance, §6.1); the efficiency table is one generic guess for every suite,
{1: 1.0, 2: 0.9}, not measured per suite (the profiling pass prints what -n 2 really gave, to set beside it).

Every run is a fresh in-process broker on this machine's Docker engine (a node on ``--cores``, SQLite, the
service's defaults: a malleable run starts as many workers as the cores it starts on). Policies run in rotated
order (A B C, B C A, C A B, ...) so that load from elsewhere on this shared machine falls on each alike; each
figure is the median over rounds. A test run whose pytest exits non-zero is still a succeeded action, but a suite
must exit alike under every policy and in profiling, or the bench says so and fails.

    python -m loadtest.bench_real_suites [--rounds 3] [--trajectories 6] [--stagger 2] [--think 0.5] [--cores 0-1]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from clients import AsyncTangramClient
from clients.records import ActionRecord
from loadtest.suites import DEFAULT_CACHE_DIR, SUITES, Fetched, fetch
from tangram.config import ServerConfig, parse_config
from tangram.service import running_broker

#: policy name -> the fixed DoP its test runs ask for (None: elastic 1..ELASTIC_MAX, malleable)
POLICIES: dict[str, int | None] = {"tangram": None, "dop1": 1, "dop2": 2}
ELASTIC_MAX = 2
#: the same guess for every suite: the bench does not tune the broker's model to each suite
EFFICIENCY = {"1": 1.0, "2": 0.9}
#: every action's deadline, queueing included (a 50 s suite behind others on a shared machine must not time out)
ACTION_TIMEOUT_S = 1200.0
PYTEST = "python3 -m pytest -p no:cacheprovider"
#: pytest's closing count line ("8 failed, 1799 passed in 21.95s")
SUMMARY = re.compile(r"\d+ (passed|failed|error)")


def broker_config(cores: str, db: Path, engine: str) -> dict[str, Any]:
    return {"store": {"url": f"sqlite+aiosqlite:///{db}"}, "gpu": {"enabled": False},
            "cpu": {"broker_id": f"bench-{uuid.uuid4().hex[:8]}",
                    "nodes": {"n1": {"backend": "docker", "engine": engine, "cores": cores, "memory_mb": 8192}}}}


@asynccontextmanager
async def fresh_broker(cores: str, engine: str) -> AsyncIterator[str]:
    """A fresh broker with its own store on a free loopback port, for one run only: no learned durations or
    sandboxes carry over from one policy's run to the next. Yields its URL."""
    with tempfile.TemporaryDirectory() as directory:
        config = parse_config(broker_config(cores, Path(directory) / "bench.db", engine))
        async with running_broker(config) as (_, app):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            try:
                yield f"http://127.0.0.1:{runner.addresses[0][1]}"
            finally:
                await runner.cleanup()


@dataclass(frozen=True)
class Step:
    """One action of a trajectory: a short tool call, or the closing test run."""

    kind: str  # "unpack" (the first: it makes the sandbox) | "tool" | "test"
    body: dict[str, Any]


@dataclass
class Outcome:
    """What one action came to, as the bench counts it."""

    suite: str
    kind: str
    state: str
    act_s: float
    queue_s: float
    exit_code: int | None
    cores: float  # time-averaged for a malleable run
    workers: int
    resizes: int
    duration_s: float  # the command's own run time
    summary: str  # pytest's count line (else its last line, or the error)
    problem: str | None  # why it counts as a failure


@dataclass
class RunResult:
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)  # trajectory -> its actions in order
    wall_s: float = 0.0

    def failures(self) -> list[str]:
        return [f"{trajectory} {o.kind} ({o.suite}): {o.problem}"
                for trajectory, rows in self.outcomes.items() for o in rows if o.problem]


def exec_body(suite: str, kind: str, command: str, demand: Any, *, elasticity: dict[str, Any] | None = None,
              pytest_parallel: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"command": command}
    if pytest_parallel:
        spec["pytest_parallel"] = True
    body: dict[str, Any] = {"kind": "exec", "demand": {"cpu": demand}, "spec": spec, "timeout_s": ACTION_TIMEOUT_S,
                            "signature": f"{kind}|{suite}"}
    if elasticity is not None:
        body["elasticity"] = elasticity
    return body


def unpack_step(fetched: Fetched, memory_mb: int) -> Step:
    """The first action: it creates the sandbox (its memory is reserved for its life) with the sdist in it and
    unpacks it (the tarball goes as base64 in ``files``, the only way into a sandbox without network)."""
    tarball = fetched.suite.sdist
    command = f"tar --no-same-owner -xzf {tarball} && rm {tarball} && ls {fetched.root}"
    body = exec_body(fetched.suite.name, "unpack", command, 1)
    body["spec"].update(files={tarball: {"base64": fetched.base64}}, memory_mb=memory_mb)
    return Step("unpack", body)


def tool_steps(fetched: Fetched) -> list[Step]:
    """Short tool calls an agent makes while it reads the code (tens to a few hundred ms each)."""
    root, package = fetched.root, fetched.suite.package
    commands = [f"grep -rn 'def ' {root}/{package} | head -n 40",
                (f"python3 -c \"import sys; sys.path.insert(0, '{root}'); import {package} as m; "
                 f"print(m.__name__, len(dir(m)))\""),
                f"find {root} -name '*.py' | xargs wc -l | tail -n 1"]
    return [Step("tool", exec_body(fetched.suite.name, "tool", command, 1)) for command in commands]


def test_step(fetched: Fetched, policy: str, t1_s: float) -> Step:
    """The trajectory's test run under ``policy``: elastic (the broker rewrites ``pytest`` to ``pytest -n W`` for
    W > 1) or fixed at 1 core (plain) or 2 (``-n 2``)."""
    suite = fetched.suite
    dop = POLICIES[policy]
    where = f"cd {fetched.root} && "
    if dop is None:
        return Step("test", exec_body(suite.name, "test", f"{where}{PYTEST} {suite.test_args}",
                                      {"min": 1, "max": ELASTIC_MAX}, pytest_parallel=True,
                                      elasticity={"resource": "cpu", "t1": t1_s, "efficiency": EFFICIENCY}))
    workers = f" -n {dop}" if dop > 1 else ""
    return Step("test", exec_body(suite.name, "test", f"{where}{PYTEST}{workers} {suite.test_args}", dop))


def outcome_of(record: ActionRecord, suite: str, kind: str) -> Outcome:
    result = record.result if isinstance(record.result, dict) else {}
    allocation = record.allocation or {}
    malleable = allocation.get("malleable") or {}
    execution = record.timings.get("execution_s") or 0.0
    units = (allocation.get("units") or {}).get("cpu", 0)
    cores = malleable["unit_seconds"] / execution if malleable and execution > 0 else float(units)
    exit_code = result.get("exit_code")
    lines = [line for line in str(result.get("stdout", "")).splitlines() if line.strip()]
    counts = [line for line in lines if SUMMARY.search(line)]
    problem = None
    if not record.succeeded:
        error = record.error or {}
        problem = f"{record.state}: {error.get('code')}: {error.get('message')}"
    elif kind != "test" and exit_code != 0:
        problem = f"tool call exited {exit_code}: {str(result.get('stderr', ''))[-300:]}"
    summary = (counts or lines or [problem or ""])[-1].strip("= ")
    return Outcome(suite, kind, record.state, float(record.timings.get("act_s") or 0.0),
                   float(record.timings.get("queue_s") or 0.0), exit_code, cores, int(malleable.get("workers", units)),
                   int(malleable.get("resizes", 0)), float(result.get("duration_s") or 0.0), summary, problem)


def body_size(step: Step) -> int:
    """The action's JSON size; refuse to send what the broker would refuse (413): the HTTP body limit binds before
    the spec's 16 MiB of files does."""
    size = len(orjson.dumps(step.body))
    if size > ServerConfig.max_body_bytes:
        raise SystemExit(f"an action's body is {size} bytes, over the broker's {ServerConfig.max_body_bytes}")
    return size


async def run_trajectory(client: AsyncTangramClient, trajectory: str, steps: list[Step], suite: str,
                         start_s: float, think_s: float) -> list[Outcome]:
    """The steps in order in one sandbox, each after ``think_s`` (the LLM generating the call), stopping at the
    first failure; the sandbox is deleted at the end, as a finished trajectory's is."""
    await asyncio.sleep(start_s)
    outcomes: list[Outcome] = []
    environment = None
    try:
        for step in steps:
            await asyncio.sleep(think_s)
            record = await client.submit(**step.body, trajectory=trajectory, wait=True)
            outcomes.append(outcome_of(record, suite, step.kind))
            if isinstance(record.result, dict):
                environment = record.result.get("environment", environment)
            if outcomes[-1].problem:
                break
    finally:
        if environment is not None:
            await client.delete_environment(environment)
    return outcomes


async def run_trajectories(url: str, plan: list[tuple[str, str, list[Step], float]], think_s: float) -> RunResult:
    """Every (trajectory, suite, steps, start) of ``plan`` at once against the broker at ``url``."""
    result = RunResult()
    started = time.perf_counter()
    async with AsyncTangramClient(url, task="bench-suites", wait_chunk_s=60.0) as client, \
            asyncio.TaskGroup() as group:
        tasks = {name: group.create_task(run_trajectory(client, name, steps, suite, start, think_s))
                 for name, suite, steps, start in plan}
    result.outcomes = {name: task.result() for name, task in tasks.items()}
    result.wall_s = time.perf_counter() - started
    return result


async def profile(fetched: list[Fetched], cores: str, engine: str, memory_mb: int,
                  exit_codes: dict[str, dict[str, set[int | None]]]) -> dict[str, float] | None:
    """Each suite alone on the node, plain on one core and then ``-n 2`` on two, in one sandbox: the plain run's
    time is the suite's ``t1``. None if an action failed (printed)."""
    t1: dict[str, float] = {}
    async with fresh_broker(cores, engine) as url:
        for item in fetched:
            name = item.suite.name
            plain = Step("test", exec_body(name, "test", f"cd {item.root} && {PYTEST} {item.suite.test_args}", 1))
            double = Step("test", exec_body(name, "test", f"cd {item.root} && {PYTEST} -n 2 {item.suite.test_args}", 2))
            result = await run_trajectories(url, [(f"profile-{name}", name, [unpack_step(item, memory_mb), plain,
                                                                                double], 0.0)], 0.0)
            rows = result.outcomes[f"profile-{name}"]
            if result.failures():
                print("profiling failed: " + "; ".join(result.failures()), flush=True)
                return None
            one, two = rows[1], rows[2]
            t1[name] = one.duration_s
            exit_codes[name]["profile plain"].add(one.exit_code)
            exit_codes[name]["profile -n 2"].add(two.exit_code)
            print(f"profile {name} {item.suite.version} ({item.size / 1e6:.2f} MB sdist): plain {one.duration_s:.2f} s "
                  f"(exit {one.exit_code}: {one.summary}); -n 2 on 2 cores {two.duration_s:.2f} s "
                  f"(exit {two.exit_code}), measured E(2) = {one.duration_s / (2 * two.duration_s):.2f} "
                  f"(declared {EFFICIENCY['2']})", flush=True)
    return t1


def plan_for(fetched: list[Fetched], policy: str, t1: dict[str, float], trajectories: int, stagger_s: float,
             memory_mb: int) -> list[tuple[str, str, list[Step], float]]:
    """Trajectory i gets suite i mod len(suites) and starts at i * ``stagger_s``."""
    plan = []
    for index in range(trajectories):
        item = fetched[index % len(fetched)]
        name = item.suite.name
        steps = [unpack_step(item, memory_mb), *tool_steps(item), test_step(item, policy, t1[name])]
        plan.append((f"t{index}-{name}", name, steps, index * stagger_s))
    return plan


@dataclass
class PolicyFigures:
    trajectory_act: list[float] = field(default_factory=list)
    test_act: list[float] = field(default_factory=list)
    test_cores: list[float] = field(default_factory=list)


def report_run(label: str, result: RunResult, figures: PolicyFigures) -> None:
    per_trajectory = [sum(o.act_s for o in rows) for rows in result.outcomes.values()]
    tests = [o for rows in result.outcomes.values() for o in rows if o.kind == "test"]
    unpacks = [o for rows in result.outcomes.values() for o in rows if o.kind == "unpack"]
    tools = [o for rows in result.outcomes.values() for o in rows if o.kind == "tool"]
    figures.trajectory_act.append(statistics.fmean(per_trajectory))
    figures.test_act.append(statistics.fmean(o.act_s for o in tests))
    figures.test_cores.append(statistics.fmean(o.cores for o in tests))
    print(f"{label}: mean ACT per trajectory {figures.trajectory_act[-1]:.2f} s, test runs {figures.test_act[-1]:.2f} s "
          f"on {figures.test_cores[-1]:.2f} cores, tool calls {statistics.fmean(o.act_s for o in tools):.3f} s "
          f"(queued {statistics.fmean(o.queue_s for o in tools) * 1e3:.0f} ms), unpack "
          f"{statistics.fmean(o.act_s for o in unpacks):.2f} s, wall {result.wall_s:.1f} s", flush=True)
    print("    tests: " + ", ".join(f"{o.suite} {o.act_s:.2f} s/{o.cores:.2f}c/W{o.workers}"
                                    + (f"/{o.resizes}rs" if o.resizes else "") + f"/exit {o.exit_code}"
                                    for o in tests), flush=True)


def check_exit_codes(exit_codes: dict[str, dict[str, set[int | None]]]) -> bool:
    """Each suite must exit alike everywhere: one that behaves differently under -n 2 (or elastic) is reported."""
    same = True
    for suite, seen in exit_codes.items():
        codes = set().union(*seen.values())
        if len(codes) != 1:
            same = False
            print(f"suite {suite} exits differently: " + ", ".join(f"{where} {sorted(c, key=str)}"
                                                                  for where, c in seen.items()), flush=True)
    print("test run exit codes: " + ", ".join(f"{suite} {sorted(set().union(*seen.values()), key=str)}"
                                              for suite, seen in exit_codes.items()), flush=True)
    return same


async def bench(args: argparse.Namespace) -> int:
    fetched = [fetch(suite, Path(args.cache_dir).expanduser()) for suite in SUITES]
    largest = max(body_size(unpack_step(item, args.memory_mb)) for item in fetched)
    print(f"suites: {', '.join(f'{f.suite.name} {f.suite.version}' for f in fetched)}; Docker node on cores "
          f"{args.cores}; {args.trajectories} trajectories staggered {args.stagger:g} s, think {args.think:g} s; "
          f"elastic test runs declare efficiency {EFFICIENCY} for every suite; largest action body "
          f"{largest / 2**20:.2f} MiB (limit {ServerConfig.max_body_bytes / 2**20:g})", flush=True)
    exit_codes: dict[str, dict[str, set[int | None]]] = defaultdict(lambda: defaultdict(set))
    t1 = await profile(fetched, args.cores, args.engine, args.memory_mb, exit_codes)
    if t1 is None:
        return 1
    names = list(POLICIES)
    figures = {name: PolicyFigures() for name in names}
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for policy in order:
            plan = plan_for(fetched, policy, t1, args.trajectories, args.stagger, args.memory_mb)
            async with fresh_broker(args.cores, args.engine) as url:
                result = await run_trajectories(url, plan, args.think)
            if result.failures():
                print(f"round {round_index + 1} {policy}: {len(result.failures())} actions failed:\n  "
                      + "\n  ".join(result.failures()), flush=True)
                return 1
            for rows in result.outcomes.values():
                for o in rows:
                    if o.kind == "test":
                        exit_codes[o.suite][policy].add(o.exit_code)
            report_run(f"round {round_index + 1} {policy:>7}", result, figures[policy])
    medians = {name: statistics.median(f.trajectory_act) for name, f in figures.items()}
    print("median mean ACT per trajectory: " + ", ".join(f"{n} {v:.2f} s" for n, v in medians.items()))
    print("median test runs: " + ", ".join(f"{n} {statistics.median(f.test_act):.2f} s on "
                                           f"{statistics.median(f.test_cores):.2f} cores" for n, f in figures.items()))
    best = min((name for name in names if name != "tangram"), key=medians.__getitem__)
    tangram = figures["tangram"].trajectory_act
    print(f"best fixed ({best}) / tangram: {medians[best] / medians['tangram']:.3f}  "
          f"(range over rounds: tangram {min(tangram):.2f}-{max(tangram):.2f} s, "
          f"{best} {min(figures[best].trajectory_act):.2f}-{max(figures[best].trajectory_act):.2f} s)", flush=True)
    return 0 if check_exit_codes(exit_codes) else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_real_suites", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=6, help="suites are assigned round-robin")
    parser.add_argument("--stagger", type=float, default=2.0, help="seconds between trajectories' starts")
    parser.add_argument("--think", type=float, default=0.5, help="seconds before each action (LLM generation)")
    parser.add_argument("--memory-mb", type=int, default=1024, help="each sandbox's memory")
    parser.add_argument("--cores", default="0-1")
    parser.add_argument("--engine", default="unix:///var/run/docker.sock")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="where sdists are kept")
    args = parser.parse_args()
    return asyncio.run(bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
