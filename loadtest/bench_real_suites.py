"""Real suites: real pytest suites of PyPI projects as trajectories' test runs, elastic against fixed DoP 1 and 2.

``bench_real_dop`` burns CPU for a trace's durations; here the work is real: each trajectory unpacks a pinned sdist
(``loadtest.suites``) in its sandbox, makes a few short tool calls with think time between them, and ends with the
project's own test suite as one ``exec``. Policies differ only in that last action: ``tangram`` asks for 1-2 cores,
malleable, with a declared elasticity; ``dop1`` for one core; ``dop2`` for two. Every policy's test run asks for
``pytest_parallel``, so the broker runs each on the same runner (``--runner``: the elastic runner by default, whose
workers follow a malleable run's cores; fixed at 2 for DoP 2, plain pytest on one core), or on xdist (``pytest -n
2`` for DoP 2): the elastic policy is never given a cheaper worker than the fixed ones. The declared ``t1`` is each
suite's single-core time from a profiling pass the bench runs first (the paper profiles in advance, §6.1); the
efficiency table is one generic guess for every suite, {1: 1.0, 2: 0.9}, not measured per suite (the profiling pass
prints what -n 2 really gave, to set beside it).

With ``--no-profiles`` the elastic runs declare nothing but ``{"resource": "cpu"}`` (no ``t1``, no efficiency): the
broker learns each suite's speed-up from its runs (``tangram.sched.speedup``, per signature ``test|<suite>``), so its
first run of a suite goes at the minimum and later ones explore. That policy then keeps one store across rounds (it
starts cold in round 1 and keeps what it learned), so its figures include the cost of learning; after each of its rounds
the bench prints what the broker learned (``GET /v1/profiles``). The profiling pass still runs, for reference only.

Every run is a fresh in-process broker (but see ``--no-profiles``) on this machine's Docker engine (a node on
``--cores``, SQLite, the service's defaults: a malleable run starts as many workers as the cores it starts on).
Policies run in rotated order (A B C, B C A, C A B, ...) so that load from elsewhere on this shared machine falls on
each alike; each figure is the median over rounds, and ours / best fixed DoP is also given per round. A test run
whose pytest exits non-zero is still a succeeded action, but a suite must exit alike under every policy and in
profiling, or the bench says so and fails.

    python -m loadtest.bench_real_suites [--rounds 3] [--trajectories 6] [--stagger 2] [--think 0.5] [--cores 0-1]
                                         [--no-profiles [--no-profiling]] [--engine URL|local]
                                         [--runner tangram|xdist]
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

import aiohttp
import orjson
from aiohttp import web

from loadtest.suites import DEFAULT_CACHE_DIR, REAL_MODE, SUITES, Fetched, fetch
from managers.cpu.exec_spec import PytestRunner
from tangram.config import ServerConfig, parse_config
from tangram.core.action import Elasticity
from tangram.sched.speedup import SpeedupFit
from tangram.service import running_broker
from tangram_client import AsyncTangramClient
from tangram_client.records import ActionRecord

#: policy name -> the fixed DoP its test runs ask for (None: elastic 1..ELASTIC_MAX, malleable)
POLICIES: dict[str, int | None] = {"tangram": None, "dop1": 1, "dop2": 2}
ELASTIC_MAX = 2
#: the same guess for every suite: the bench does not tune the broker's model to each suite
EFFICIENCY = {"1": 1.0, "2": 0.9}
#: the node's memory, unless the trajectories' sandboxes need more
NODE_MEMORY_MB = 8192
#: every action's deadline, queueing included (a 50 s suite behind others on a shared machine must not time out)
ACTION_TIMEOUT_S = 1200.0
PYTEST = "python3 -m pytest -p no:cacheprovider"
#: what an elastic test run declares with --no-profiles: only its key resource
UNDECLARED = Elasticity("cpu")
#: pytest's closing count line ("8 failed, 1799 passed in 21.95s")
SUMMARY = re.compile(r"\d+ (passed|failed|error)")


def broker_config(cores: str, db: Path, engine: str, broker_id: str | None = None,
                  worker_overhead: float | None = None, memory_mb: int = NODE_MEMORY_MB,
                  runner: PytestRunner = "tangram") -> dict[str, Any]:
    """``engine`` "local": the node runs its sandboxes as local processes (a machine without Docker)."""
    tuned: dict[str, Any] = {"pytest_runner": runner}
    if worker_overhead is not None:
        tuned["worker_overhead"] = worker_overhead
    backend = ({"backend": "local", "unsandboxed": True} if engine == "local"
               else {"backend": "docker", "engine": engine})
    return {"store": {"url": f"sqlite+aiosqlite:///{db}"}, "gpu": {"enabled": False},
            "cpu": {"broker_id": broker_id or f"bench-{uuid.uuid4().hex[:8]}", **tuned,
                    "nodes": {"n1": {**backend, "cores": cores, "memory_mb": memory_mb}}}}


@asynccontextmanager
async def fresh_broker(cores: str, engine: str, store: Path | None = None, worker_overhead: float | None = None,
                       memory_mb: int = NODE_MEMORY_MB, pytest_runner: PytestRunner = "tangram"
                       ) -> AsyncIterator[str]:
    """A fresh broker on a free loopback port. With no ``store``, it has its own store for one run only: no learned
    durations or sandboxes carry over from one policy's run to the next. With ``store`` (a SQLite file), it loads
    what the brokers before it on that file learned and leaves what it learns there. Yields its URL."""
    with tempfile.TemporaryDirectory() as directory:
        db, broker_id = (Path(directory) / "bench.db", None) if store is None else (store, "bench-learned")
        config = parse_config(broker_config(cores, db, engine, broker_id, worker_overhead, memory_mb,
                                            pytest_runner))
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
    allocation: dict[str, Any] | None = None  # the record's: units, placement, malleable (bounds, resizes, history)


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


def test_step(fetched: Fetched, policy: str, t1_s: float | None) -> Step:
    """The trajectory's test run under ``policy``: elastic or fixed at 1 or 2 cores, each rewritten by the broker
    for its runner. An elastic run declares ``t1_s`` and ``EFFICIENCY``, or, with ``t1_s`` None, no profile at all
    (the broker learns it per suite: the signature is ``test|<suite>``)."""
    suite = fetched.suite
    dop = POLICIES[policy]
    where = f"cd {fetched.root} && "
    if dop is None:
        elasticity: dict[str, Any] = {"resource": "cpu"}
        if t1_s is not None:
            elasticity.update(t1=t1_s, efficiency=EFFICIENCY)
        return Step("test", exec_body(suite.name, "test", f"{where}{PYTEST} {suite.test_args}",
                                      {"min": 1, "max": ELASTIC_MAX}, pytest_parallel=True, elasticity=elasticity))
    return Step("test", exec_body(suite.name, "test", f"{where}{PYTEST} {suite.test_args}", dop,
                                  pytest_parallel=True))


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
                   int(malleable.get("resizes", 0)), float(result.get("duration_s") or 0.0), summary, problem,
                   record.allocation)


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


def plan_for(fetched: list[Fetched], policy: str, t1: dict[str, float] | None, trajectories: int, stagger_s: float,
             memory_mb: int) -> list[tuple[str, str, list[Step], float]]:
    """Trajectory i gets suite i mod len(suites) and starts at i * ``stagger_s``; with ``t1`` None, elastic test runs
    declare no profile."""
    plan = []
    for index in range(trajectories):
        item = fetched[index % len(fetched)]
        name = item.suite.name
        steps = [unpack_step(item, memory_mb), *tool_steps(item),
                 test_step(item, policy, None if t1 is None else t1[name])]
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


def report_allocations(result: RunResult) -> None:
    """Each test run's allocation as its record shows it: units at the end and, for a malleable run, its floor,
    workers, resizes, unit-seconds and units over time (seconds from its start)."""
    for trajectory, rows in result.outcomes.items():
        for o in rows:
            if o.kind != "test":
                continue
            allocation = o.allocation or {}
            malleable = allocation.get("malleable")
            if malleable:
                start = malleable["history"][0][0] if malleable.get("history") else 0.0
                history = " ".join(f"+{t - start:.1f}s:{u}" for t, u in malleable.get("history", []))
                assumed = " (assumed)" if malleable.get("assumed") else ""
                shown = (f"malleable{assumed} floor {malleable.get('floor')} workers {malleable.get('workers')} "
                         f"resizes {malleable.get('resizes')} unit_seconds {malleable.get('unit_seconds', 0.0):.1f} "
                         f"history [{history}]")
            else:
                shown = "not malleable"
            print(f"      {trajectory}: units {allocation.get('units')}, {shown}, ran {o.duration_s:.2f} s", flush=True)


async def learned_profiles(url: str) -> list[dict[str, Any]]:
    """What the broker at ``url`` has learned per (task, signature): ``GET /v1/profiles``."""
    async with aiohttp.ClientSession() as session, \
            session.get(f"{url}/v1/profiles", params={"limit": "10000"}) as response:
        response.raise_for_status()
        return (await response.json())["profiles"]


def report_learned(label: str, profiles: list[dict[str, Any]]) -> None:
    """Per test signature, the runs the speed-up model has (units, workers, how many, median seconds), its fit
    (``tangram.sched.speedup``; nothing declared, so ``P(m) = 1/m``) and what it predicts on 1 and 2 cores."""
    print(f"{label}: learned", flush=True)
    for row in sorted((r for r in profiles if r["signature"].startswith("test|")), key=lambda r: r["signature"]):
        speedup = row["speedup"]
        if not speedup:
            print(f"    {row['signature']}: no runs (T1 {row['t1_s']:.2f} s over {row['samples']} samples)", flush=True)
            continue
        fit = SpeedupFit(speedup["serial_s"], speedup["scale"], speedup["per_worker_s"], speedup["harness_s"],
                         speedup["trusted_units"])
        predicted = {m: fit.duration(UNDECLARED, m) for m in range(1, ELASTIC_MAX + 1)}
        by_units = "; ".join(f"{u['units']:g} cores/W{u['workers']}: {u['runs']}x median {u['median_s']:.2f} s"
                             for u in speedup["by_units"])
        predictions = ", ".join(f"T({m}) {t:.2f} s" for m, t in predicted.items())
        print(f"    {row['signature']}: {speedup['runs']} runs [{by_units}]; fit serial {fit.serial_s:.2f} s, parallel "
              f"{fit.scale:.2f} s, {fit.per_worker_s:.2f} CPU s per worker, {fit.harness_s:.2f} s to go parallel, "
              f"trusted to {fit.trusted:g} cores; predicts {predictions}", flush=True)


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
    fetched = [fetch(suite, Path(args.cache_dir).expanduser()) for suite in SUITES if suite.name in REAL_MODE]
    declares = ("elastic test runs declare no profile (learned per suite, one store across rounds)" if args.no_profiles
                else f"elastic test runs declare efficiency {EFFICIENCY} for every suite")
    largest = max(body_size(unpack_step(item, args.memory_mb)) for item in fetched)
    node = "local-process node" if args.engine == "local" else "Docker node"
    print(f"suites: {', '.join(f'{f.suite.name} {f.suite.version}' for f in fetched)}; {node} on cores "
          f"{args.cores}; test runs on {args.runner}; {args.trajectories} trajectories staggered {args.stagger:g} s, "
          f"think {args.think:g} s; {declares}; largest action body "
          f"{largest / 2**20:.2f} MiB (limit {ServerConfig.max_body_bytes / 2**20:g})", flush=True)
    exit_codes: dict[str, dict[str, set[int | None]]] = defaultdict(lambda: defaultdict(set))
    t1 = None
    if not args.no_profiling:
        t1 = await profile(fetched, args.cores, args.engine, args.memory_mb, exit_codes)
        if t1 is None:
            return 1
    names = list(POLICIES)
    fixed = [name for name in names if name != "tangram"]
    figures = {name: PolicyFigures() for name in names}
    ratios: list[float] = []
    node_mb = max(NODE_MEMORY_MB, args.trajectories * args.memory_mb)  # every sandbox at once
    with tempfile.TemporaryDirectory() as learned_dir:
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for policy in order:
                plan = plan_for(fetched, policy, None if args.no_profiles else t1, args.trajectories, args.stagger,
                                args.memory_mb)
                # --no-profiles: the elastic policy's brokers share one store, cold in round 1, learning across rounds
                store = Path(learned_dir) / "learned.db" if args.no_profiles and policy == "tangram" else None
                async with fresh_broker(args.cores, args.engine, store, args.worker_overhead, node_mb,
                                        args.runner) as url:
                    result = await run_trajectories(url, plan, args.think)
                    learned = await learned_profiles(url) if store is not None else None
                if result.failures():
                    print(f"round {round_index + 1} {policy}: {len(result.failures())} actions failed:\n  "
                          + "\n  ".join(result.failures()), flush=True)
                    return 1
                for rows in result.outcomes.values():
                    for o in rows:
                        if o.kind == "test":
                            exit_codes[o.suite][policy].add(o.exit_code)
                report_run(f"round {round_index + 1} {policy:>7}", result, figures[policy])
                if learned is not None:
                    report_allocations(result)
                    report_learned(f"round {round_index + 1} {policy:>7}", learned)
            best_now = min(fixed, key=lambda name: figures[name].trajectory_act[-1])
            ratios.append(figures["tangram"].trajectory_act[-1] / figures[best_now].trajectory_act[-1])
            print(f"round {round_index + 1}: ours / best fixed ({best_now}) mean ACT per trajectory {ratios[-1]:.3f}",
                  flush=True)
    medians = {name: statistics.median(f.trajectory_act) for name, f in figures.items()}
    print("median mean ACT per trajectory: " + ", ".join(f"{n} {v:.2f} s" for n, v in medians.items()))
    print("median test runs: " + ", ".join(f"{n} {statistics.median(f.test_act):.2f} s on "
                                           f"{statistics.median(f.test_cores):.2f} cores" for n, f in figures.items()))
    best = min(fixed, key=medians.__getitem__)
    tangram = figures["tangram"].trajectory_act
    print(f"best fixed ({best}) / tangram: {medians[best] / medians['tangram']:.3f}  "
          f"(range over rounds: tangram {min(tangram):.2f}-{max(tangram):.2f} s, "
          f"{best} {min(figures[best].trajectory_act):.2f}-{max(figures[best].trajectory_act):.2f} s)", flush=True)
    print(f"ours / best fixed per round (each round's best fixed DoP): median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} rounds "
          f"({', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    return 0 if check_exit_codes(exit_codes) else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_real_suites", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=6, help="suites are assigned round-robin")
    parser.add_argument("--stagger", type=float, default=2.0, help="seconds between trajectories' starts")
    parser.add_argument("--think", type=float, default=0.5, help="seconds before each action (LLM generation)")
    parser.add_argument("--memory-mb", type=int, default=1024, help="each sandbox's memory")
    parser.add_argument("--cores", default="0-1")
    parser.add_argument("--engine", default="unix:///var/run/docker.sock",
                        help='the Docker engine of the node, or "local" for local-process sandboxes')
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="where sdists are kept")
    parser.add_argument("--worker-overhead", type=float, help="the brokers' cpu.worker_overhead (default: the "
                                                                  "service's)")
    parser.add_argument("--runner", choices=["tangram", "xdist"], default="tangram",
                        help="what every policy's test runs run on (the brokers' cpu.pytest_runner)")
    parser.add_argument("--no-profiles", action="store_true",
                        help="elastic test runs declare no t1 or efficiency (the broker learns them per suite); the "
                             "elastic policy keeps one store across rounds, cold in the first")
    parser.add_argument("--no-profiling", action="store_true",
                        help="skip the profiling pass (with --no-profiles, where it is for reference only)")
    args = parser.parse_args()
    if args.no_profiling and not args.no_profiles:
        parser.error("--no-profiling needs --no-profiles: the elastic runs declare the profiled t1")
    return asyncio.run(bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
