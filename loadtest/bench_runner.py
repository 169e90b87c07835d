"""The elastic runner against xdist and plain pytest on real suites, run directly on pinned cores (no broker).

Each suite of ``loadtest.suites`` is unpacked once and its own tests run, as ``python -m pytest`` from the sdist's
root, with the process pinned to a set of cores, under every configuration of ``plan``:

- ``plain``: plain pytest on one core (the baseline every speed-up is against);
- ``runner 1c/1w`` and ``1c/2w``, ``xdist 1c/2w``: what one worker, or two squeezed onto one core, cost;
- ``xdist`` and ``runner`` with W = c workers on c = 2, 4, 8, ... cores up to the cores given, and with
  ``--parallex`` pytest-parallex's fork mode too (it collects once and forks, at a width fixed at launch; the suites'
  interpreter must have it installed);
- with ``--long-tests``, ``tangram ... long known`` at each width: the runner given the long tests of the suite's
  first runner run of the bench (what the broker gives a signature's runs after its first), so that no slice waits
  behind one; against it, the same width without them;
- ``grown a->b``: the runner started on ``a`` cores with ``a`` workers and moved onto ``b`` cores (every thread of
  its process tree re-pinned by the executor's own ``pin_tree``) a third of the way through the plain run's time:
  the coordinator must fork the workers the new cores allow. Against it, staying on ``a`` cores (``runner a``).

Every run's counts (passed, failed, skipped, ...) and exit code must equal plain pytest's (parity), and every
runner run must say it forked its workers (its ``tangram-runner:`` line). Rounds alternate the order of the
configurations; figures are medians over rounds. A preflight says whether this machine honours CPU affinity at all
(two busy processes pinned to one core must take twice as long as one) and which cores are SMT siblings.

    python -m loadtest.bench_runner [--cores 0-1] [--rounds 2] [--suite NAME] [--python PYTHON] [--grow 1:2]
                                    [--parallex] [--long-tests] [--budget-s S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.suites import DEFAULT_CACHE_DIR, SUITES, Fetched, fetch
from managers.cpu.long_tests import LONG_TESTS_ENV, long_tests_from
from sandboxes.cgroup import parse_cpu_list
from sandboxes.executor import RUNNER_DIR, pin_tree

#: pytest's closing line, e.g. "8 failed, 1799 passed, 12 skipped in 21.95s"
COUNT = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|deselected)\b")
RUNNER_LINE = "tangram-runner:"
#: a line of pytest's short summary (-rfE): "FAILED tests/test_a.py::test_b - AssertionError"
SHORT_SUMMARY = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
#: the re-pin of a grown run, as a share of the plain run's time
GROW_AT = 1 / 3


@dataclass(frozen=True)
class Config:
    """One way of running a suite: ``runner`` is plain, xdist, parallex or tangram; ``grow_to`` > 0 moves it
    there; ``long_known``: the runner is given the tests an earlier run found long."""

    runner: str
    cores: int
    workers: int
    grow_to: int = 0
    long_known: bool = False

    @property
    def label(self) -> str:
        if self.runner == "plain":
            return "plain"
        if self.grow_to:
            return f"grown {self.cores}->{self.grow_to}"
        return f"{self.runner} {self.cores}c/{self.workers}w" + (" long known" if self.long_known else "")


@dataclass
class Ran:
    seconds: float
    exit_code: int
    counts: dict[str, int]
    runner_line: str
    #: the node ids pytest's short summary names as failed or in error
    failed: frozenset[str] = frozenset()
    #: the tests the runner found long (its ``--tangram-long-tests`` line), empty for the other runners
    long_tests: dict[str, float] = field(default_factory=dict)


def plan(cores: int, grows: list[tuple[int, int]], one_core: bool = True, parallex: bool = False,
         long_tests: bool = False) -> list[Config]:
    """Plain pytest first (the grown runs' timing needs it), then the one-core runs (unless ``one_core`` is
    False), the widths (pytest-parallex's too, if ``parallex``; the runner given long tests too, if
    ``long_tests``: after a runner run that names them) and the grown runs."""
    configs = [Config("plain", 1, 1)]
    if one_core:
        configs += [Config("tangram", 1, 1), Config("tangram", 1, 2), Config("xdist", 1, 2)]
    c = 2
    while c <= cores:
        configs += [Config("xdist", c, c), Config("tangram", c, c)]
        if long_tests:
            configs.append(Config("tangram", c, c, long_known=True))
        if parallex:
            configs.append(Config("parallex", c, c))
        c *= 2
    for start, end in grows:
        if end <= cores:
            if start > 1 and Config("tangram", start, start) not in configs:
                configs.append(Config("tangram", start, start))
            configs.append(Config("tangram", start, start, end))
    return configs


def counts_of(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (errors and error alike)."""
    lines = [line for line in output.splitlines() if COUNT.search(line) and " in " in line]
    if not lines:
        return {}
    return {("errors" if kind.startswith("error") else kind): int(n) for n, kind in COUNT.findall(lines[-1])}


def run_once(python: str, fetched: Fetched, workdir: Path, config: Config, cpus: list[int], grow_after_s: float,
             long_tests: dict[str, float] | None = None) -> Ran:
    flags: list[str] = []
    env = dict(os.environ)
    if config.runner == "xdist":
        flags = ["-n", str(config.workers)]
    elif config.runner == "parallex":
        flags = ["--parallel", "fork", "--parallel-workers", str(config.workers)]
    elif config.runner == "tangram":
        flags = ["-p", "tangram_runner", f"--tangram-workers={config.workers}",
                 f"--tangram-launch-cores={config.cores}", "--tangram-long-tests"]
        env["PYTHONPATH"] = RUNNER_DIR
        if config.long_known:
            env[LONG_TESTS_ENV] = json.dumps(long_tests or {})
    command = [python, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", *flags, *fetched.suite.test_args.split()]
    start_cpus = set(cpus[:config.cores])
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=workdir / fetched.root, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: os.sched_setaffinity(0, start_cpus))  # noqa: PLW1509 - no
    # other thread runs here: a grown run's timer starts after this
    timer = None
    if config.grow_to:
        timer = threading.Timer(grow_after_s, pin_tree, (process.pid, set(cpus[:config.grow_to])))
        timer.start()
    output, _ = process.communicate()
    seconds = time.perf_counter() - started
    if timer is not None:
        timer.cancel()
    said = [line for line in output.splitlines() if RUNNER_LINE in line]
    return Ran(seconds, process.returncode, counts_of(output), said[-1].strip() if said else "",
               frozenset(SHORT_SUMMARY.findall(output)), long_tests_from(output))


def affinity_check(cpus: list[int]) -> dict[str, Any]:
    """Whether pinning binds: the wall time of two CPU-bound processes pinned to one core, over one's."""
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"

    def wall(copies: int) -> float:
        started = time.perf_counter()
        processes = [subprocess.Popen([sys.executable, "-c", burn],
                                      preexec_fn=lambda: os.sched_setaffinity(0, {cpus[0]}))  # noqa: PLW1509
                     for _ in range(copies)]
        for process in processes:
            process.wait()
        return time.perf_counter() - started

    ratio = wall(2) / wall(1)
    lists = (Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") for c in cpus)
    siblings = sorted({path.read_text().strip() for path in lists if path.exists()})
    return {"two_on_one_core_over_one": ratio, "honoured": ratio > 1.6, "smt_siblings": siblings}


def unpack(python: str, fetched: Fetched, cache_dir: Path, into: Path) -> None:
    """The sdist unpacked under ``into``, its tests collected once untimed (so that no timed run compiles the
    sources or rewrites the tests' asserts)."""
    with tarfile.open(cache_dir / fetched.suite.sdist) as tar:
        tar.extractall(into, filter="data")
    subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                    *fetched.suite.test_args.split()], cwd=into / fetched.root, capture_output=True, check=False)


def bench(args: argparse.Namespace) -> int:
    cpus = sorted(parse_cpu_list(args.cores))
    grows = [tuple(int(x) for x in g.split(":")) for g in args.grow]
    configs = plan(len(cpus), grows, not args.no_one_core, args.parallex, args.long_tests)  # type: ignore[arg-type]
    cache = Path(args.cache_dir).expanduser()
    by_name = {suite.name: suite for suite in SUITES}
    fetched = [fetch(by_name[name], cache) for name in args.suite or by_name]  # in the order given
    version = subprocess.run([args.python, "-m", "pytest", "--version"], capture_output=True, text=True,
                             check=False)
    check = affinity_check(cpus)
    print(f"cores {args.cores} ({len(cpus)}); {os.uname().release}; suites' python {args.python}: "
          f"{(version.stdout + version.stderr).strip()}; two busy processes on one core take "
          f"{check['two_on_one_core_over_one']:.2f}x one's time "
          f"(affinity {'honoured' if check['honoured'] else 'NOT honoured'}); "
          f"SMT siblings {check['smt_siblings']}", flush=True)
    deadline = time.perf_counter() + args.budget_s
    times: dict[str, dict[Config, list[Ran]]] = {item.suite.name: defaultdict(list) for item in fetched}
    with tempfile.TemporaryDirectory() as directory:
        for item in fetched:
            unpack(args.python, item, cache, Path(directory))
        for round_index in range(args.rounds):  # every suite once before any twice: a budget cuts rounds short
            for item in fetched:
                kept = times[item.suite.name]
                for config in configs if round_index % 2 == 0 else configs[::-1]:
                    if time.perf_counter() > deadline:
                        break
                    plain = [r.seconds for r in kept[configs[0]]]
                    if config.grow_to and not plain:
                        continue  # grown a third of the way through the plain run's time: not known yet
                    learned = next((r.long_tests for runs in kept.values() for r in runs if r.long_tests), None)
                    if config.long_known and learned is None:
                        continue  # no runner run has named its long tests yet
                    ran = run_once(args.python, item, Path(directory), config, cpus,
                                   GROW_AT * statistics.median(plain) if plain else 0.0, learned)
                    kept[config].append(ran)
                    print(f"  {item.suite.name} round {round_index + 1} {config.label}: {ran.seconds:.2f} s exit "
                          f"{ran.exit_code} {ran.counts} {ran.runner_line}", flush=True)
    figures = report(times, configs)
    figures["affinity"] = check
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": args.cores, "rounds": args.rounds, **figures}, indent=2))
    return 0 if figures["parity"] and figures["runner_ran"] else 1


def report(times: dict[str, dict[Config, list[Ran]]], configs: list[Config]) -> dict[str, Any]:
    """Per suite: medians, speed-ups over plain, the runner over xdist, the squeezed and grown ratios, parity."""
    suites: dict[str, Any] = {}
    parity = runner_ran = True
    for name, by_config in times.items():
        plain = by_config.get(configs[0])
        if not plain:
            continue
        base = statistics.median(r.seconds for r in plain)
        reference = (plain[0].counts, plain[0].exit_code)
        medians = {c: statistics.median(r.seconds for r in runs) for c, runs in by_config.items() if runs}
        mismatched = sorted({c.label for c, runs in by_config.items() for r in runs
                             if (r.counts, r.exit_code) != reference})
        # which tests changed outcome: the evidence for telling a runner's fault from a suite's order dependence
        flipped = sorted({test for runs in by_config.values() for r in runs
                          if (r.counts, r.exit_code) != reference for test in r.failed ^ plain[0].failed})
        no_fork = sorted({c.label for c, runs in by_config.items() for r in runs
                          if c.runner == "tangram" and "forked" not in r.runner_line})
        parity &= not mismatched
        runner_ran &= not no_fork
        row: dict[str, Any] = {"median_s": {c.label: m for c, m in medians.items()},
                               "speedup": {c.label: base / m for c, m in medians.items()},
                               "counts": reference[0], "exit_code": reference[1], "parity_mismatch": mismatched,
                               "flipped": flipped,
                               "runner_did_not_fork": no_fork}
        pairs = {c.cores: (medians.get(Config("xdist", c.cores, c.cores)), m) for c, m in medians.items()
                 if c.runner == "tangram" and c.cores == c.workers and not c.grow_to and not c.long_known}
        known = {c.cores: m for c, m in medians.items() if c.long_known}
        row["long_known_over_unknown"] = {f"{c}c": pairs[c][1] / m for c, m in sorted(known.items())
                                                if c in pairs}
        row["long_known_over_xdist"] = {f"{c}c": x / m for c, m in sorted(known.items())
                                     if (x := medians.get(Config("xdist", c, c)))}
        row["runner_over_xdist"] = {f"{c}c": x / r for c, (x, r) in sorted(pairs.items()) if x}
        row["runner_over_parallex"] = {f"{c}c": p / r for c, (_, r) in sorted(pairs.items())
                                       if (p := medians.get(Config("parallex", c, c)))}
        grown = {c: m / medians[Config("tangram", c.cores, c.cores)] for c, m in medians.items()
                 if c.grow_to and Config("tangram", c.cores, c.cores) in medians}
        row["grown_over_staying"] = {c.label: ratio for c, ratio in grown.items()}
        suites[name] = row
        cells = "  ".join(f"{c.label} {m:.2f}s ({base / m:.2f}x)" for c, m in medians.items())
        print(f"{name}: {cells}", flush=True)
        print(f"{'':>10} runner faster than xdist by " + ", ".join(f"{k} {v:.2f}x" for k, v in
                                                                  row["runner_over_xdist"].items())
              + (", than pytest-parallex by " + ", ".join(f"{k} {v:.2f}x" for k, v in
                                                         row["runner_over_parallex"].items())
                 if row["runner_over_parallex"] else "")
              + ("; long tests known over not " + ", ".join(
                  f"{k} {v:.2f}x" for k, v in row["long_known_over_unknown"].items()) + ", over xdist "
                 + ", ".join(f"{k} {v:.2f}x" for k, v in row["long_known_over_xdist"].items())
                 if row["long_known_over_unknown"] else "")
              + "; grown / staying " + ", ".join(f"{k} {v:.2f}" for k, v in row["grown_over_staying"].items())
              + f"; counts {reference[0]} exit {reference[1]}"
              + (f"; PARITY MISMATCH in {mismatched}, tests whose outcome differs from plain's: {flipped}"
                 if mismatched else "; parity in every run")
              + (f"; runner did not fork in {no_fork}" if no_fork else ""), flush=True)
    return {"suites": suites, "parity": parity, "runner_ran": runner_ran}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", default="0-1", help="the cores to use (a cpuset list)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--suite", action="append", choices=[suite.name for suite in SUITES],
                        help="only this suite (repeatable; run in the order given)")
    parser.add_argument("--python", default="python3", help="the suites' interpreter (with pytest and xdist)")
    parser.add_argument("--grow", action="append", default=None, metavar="A:B",
                        help="a grown run: started on A cores, moved onto B (repeatable; default 1:2)")
    parser.add_argument("--no-one-core", action="store_true",
                        help="no runs of one worker or of two squeezed onto one core (plain pytest still runs)")
    parser.add_argument("--parallex", action="store_true",
                        help="also pytest-parallex (--parallel fork) at each width (installed in --python)")
    parser.add_argument("--long-tests", action="store_true",
                        help="also the runner given the long tests of the suite's first runner run, at each width")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no run after this many seconds")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="where sdists are kept")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    args.grow = args.grow or ["1:2"]
    return bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
