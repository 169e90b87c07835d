"""Speed-up curves of real test suites, measured: the simulator's test-run model fitted to them.

Runs the real pytest suites of ``loadtest.suites`` (five pure-Python PyPI sdists with their own tests) through a
real broker on Docker, alone on the node, at every (cores, workers) of ``configs``: plain pytest on one core, and
``pytest -n W`` with W = cores and W = 2 x cores for cores = 1, 2, 4, ... up to the node's size (the runs with
more workers than cores tell the workers' start-up apart from the parallel work). Rounds alternate the order of
the configurations. Each suite's median times are then fitted twice:

- with the **simulator's own execution model** (``tangram.sim.execution.Execution``: xdist start-up CPU
  ``start + per_worker x W`` spread over the cores, then the work at its Amdahl speed-up): work, serial fraction,
  start and per-worker CPU seconds, least squares on log times (SciPy, bounded);
- with the **broker's learned model** (``tangram.sched.speedup.fit_runs``), to show what it would conclude.

    python -m loadtest.bench_suite_curves [--rounds 3] [--cores 0-1] [--json docs/evaluation/suite_curves.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from scipy.optimize import least_squares

from loadtest.bench_real_suites import PYTEST, Step, exec_body, fresh_broker, run_trajectories, unpack_step
from loadtest.suites import DEFAULT_CACHE_DIR, SUITES, Fetched, fetch
from sandboxes.cgroup import parse_cpu_list
from tangram.sched.speedup import Run, fit_runs
from tangram.sim.cluster import Costs, startup_cpu_s
from tangram.sim.execution import Execution
from tangram.sim.trace import Call

Config = tuple[int, int]  # (cores, workers)


def configs(cores: int) -> list[Config]:
    """Plain pytest on one core, then W = c and W = 2c workers on c = 1, 2, 4, ... cores."""
    out: list[Config] = [(1, 1), (1, 2)]
    c = 2
    while c <= cores:
        out += [(c, c), (c, 2 * c)]
        c *= 2
    return out


def test_step(item: Fetched, config: Config) -> Step:
    cores, workers = config
    option = f" -n {workers}" if workers > 1 else ""
    command = f"cd {item.root} && {PYTEST}{option} {item.suite.test_args}"
    return Step("test", exec_body(item.suite.name, f"curve-{cores}c{workers}w", command, cores))


def simulated_s(params: Sequence[float] | np.ndarray, config: Config) -> float:
    """The simulator's execution time for one test run of ``config``: ``params`` = (work s, serial fraction,
    xdist start CPU s, xdist CPU s per worker)."""
    work, serial, start, per_worker = (float(x) for x in params)
    cores, workers = config
    efficiency = tuple((m, 1.0 / (serial * m + 1.0 - serial)) for m in range(1, max(2, cores) + 1))
    call = Call("test", 0.0, work, efficiency=efficiency)
    costs = Costs(test_runner="xdist", xdist_start_cpu_s=start, xdist_worker_cpu_s=per_worker)
    return Execution(call, workers, cores, 0.0, 0.0, 0.0, startup_cpu_s(costs, workers, work), work).finish_at()


def fit_simulator(medians: dict[Config, float]) -> dict[str, float]:
    """The simulator's four parameters that best reproduce ``medians`` (log-time residuals)."""
    points = sorted(medians)
    observed = np.log([medians[p] for p in points])
    plain = medians[(1, 1)]

    def residuals(params: np.ndarray) -> np.ndarray:
        return np.log([simulated_s(params, p) for p in points]) - observed

    fitted = least_squares(residuals, x0=[plain, 0.05, 0.1, 0.2], bounds=([1e-3, 0.0, 0.0, 0.0],
                                                                         [10 * plain, 1.0, 60.0, 60.0]))
    work, serial, start, per_worker = (float(x) for x in fitted.x)
    worst = float(np.max(np.abs(np.expm1(residuals(fitted.x)))))
    return {"work_s": work, "serial": serial, "xdist_start_cpu_s": start, "xdist_worker_cpu_s": per_worker,
            "worst_error": worst}


def fit_broker(times: dict[Config, list[float]]) -> dict[str, float]:
    runs = tuple(Run(float(c), w, 1.0 / c, s) for (c, w), samples in times.items() for s in samples)
    fit = fit_runs(runs)
    return {"serial_s": fit.serial_s, "scale": fit.scale, "per_worker_s": fit.per_worker_s,
            "harness_s": fit.harness_s}


async def measure(fetched: list[Fetched], cores: str, engine: str, rounds: int, memory_mb: int
                  ) -> dict[str, dict[Config, list[float]]]:
    """Each suite in its own sandbox, alone on the node: ``rounds`` passes over the configurations (the order
    reversed every other round). Returns the commands' own run times per suite and configuration."""
    plan = configs(len(parse_cpu_list(cores)))
    times: dict[str, dict[Config, list[float]]] = {}
    async with fresh_broker(cores, engine) as url:
        for item in fetched:
            name = item.suite.name
            order = [config for r in range(rounds) for config in (plan if r % 2 == 0 else plan[::-1])]
            steps = [unpack_step(item, memory_mb), *(test_step(item, config) for config in order)]
            started = time.perf_counter()
            result = await run_trajectories(url, [(f"curve-{name}", name, steps, 0.0)], 0.0)
            if result.failures():
                raise SystemExit("a run failed: " + "; ".join(result.failures()))
            times[name] = defaultdict(list)
            for config, outcome in zip(order, result.outcomes[f"curve-{name}"][1:], strict=True):
                times[name][config].append(outcome.duration_s)
            print(f"{name}: {len(order)} runs in {time.perf_counter() - started:.0f} s", flush=True)
    return times


def report(times: dict[str, dict[Config, list[float]]]) -> dict[str, Any]:
    """Print each suite's medians, its speed-up and both fits; return them for the JSON."""
    out: dict[str, Any] = {}
    for name, by_config in times.items():
        medians = {config: statistics.median(samples) for config, samples in by_config.items()}
        simulator, broker = fit_simulator(medians), fit_broker(by_config)
        top = max(c for c, w in medians if w == c)
        speedup = medians[(1, 1)] / medians[(top, top)]
        spread = max(max(s) / min(s) for s in by_config.values())
        cells = "  ".join(f"{c}c/{w}w {medians[(c, w)]:6.2f}" for c, w in sorted(medians))
        print(f"{name:>10}: {cells}  speed-up on {top} cores {speedup:.2f}x  (max/min per config {spread:.2f})")
        print(f"{'':>10}  simulator fit: work {simulator['work_s']:.2f} s, serial {simulator['serial']:.3f}, "
              f"xdist start {simulator['xdist_start_cpu_s']:.2f} CPU s + {simulator['xdist_worker_cpu_s']:.2f} "
              f"per worker (worst error {simulator['worst_error']:.1%})")
        print(f"{'':>10}  broker fit: serial {broker['serial_s']:.2f} s, parallel {broker['scale']:.2f} s, "
              f"{broker['per_worker_s']:.2f} CPU s per worker (shared by its cores), {broker['harness_s']:.2f} s to "
              f"go parallel")
        out[name] = {"seconds": {f"{c}c{w}w": samples for (c, w), samples in sorted(by_config.items())},
                     "median_s": {f"{c}c{w}w": m for (c, w), m in sorted(medians.items())},
                     "speedup": speedup, "cores": top, "simulator_fit": simulator, "broker_fit": broker}
    per_worker = [suite["simulator_fit"]["xdist_worker_cpu_s"] for suite in out.values()]
    relative = [suite["simulator_fit"]["xdist_worker_cpu_s"] / suite["simulator_fit"]["work_s"]
                for suite in out.values()]
    serial = [suite["simulator_fit"]["serial"] for suite in out.values()]
    print(f"across suites: xdist CPU per worker {min(per_worker):.2f}-{max(per_worker):.2f} s "
          f"({min(relative):.1%}-{max(relative):.1%} of the suite's work), serial fraction "
          f"{min(serial):.3f}-{max(serial):.3f}")
    return out


async def bench(args: argparse.Namespace) -> int:
    fetched = [fetch(suite, Path(args.cache_dir)) for suite in SUITES if not args.suite or suite.name in args.suite]
    started = time.perf_counter()
    times = await measure(fetched, args.cores, args.engine, args.rounds, args.memory_mb)
    figures = report(times)
    print(f"wall {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps({"cores": args.cores, "rounds": args.rounds, "suites": figures},
                                                 option=orjson.OPT_INDENT_2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", default="0-1", help="the node's cores (a cpuset list)")
    parser.add_argument("--engine", default="unix:///var/run/docker.sock")
    parser.add_argument("--memory-mb", type=int, default=2048)
    parser.add_argument("--suite", action="append", help="only this suite (repeatable)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="where sdists are kept")
    parser.add_argument("--json", help="write the times and fits here")
    return asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
