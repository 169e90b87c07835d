"""Instructions per scheduling pass, counted by Valgrind: a measure this noisy machine cannot blur.

CPU time of one pass here swings by a fifth from run to run; an instruction count does not (the same tree gives the
same count, to the million, with address-space randomisation off and a fixed hash seed). Each figure is the
difference of two runs of the same process that differ only in the passes counted, so start-up, imports and the
queue's construction cancel out:

- ``cold``: 2,048 queued actions of ``bench_scheduler`` on its idle 1,280 cores, planned by a fresh scheduler;
  three seeds, five passes each against none;
- ``steady``: ``bench_scheduler``'s closed loop (``--resize`` for malleable actions), passes 3-152 against passes 1-2.

Instructions are not time (numpy's calls, cache misses), so a change is timed as well; the count says which way a
small change goes when the clock cannot.

    python -m loadtest.pass_instructions [--tree PATH] [--steady] [--resize]

Needs Valgrind (``apt-get install valgrind``); a pass of the cold kind takes about half a minute to count.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import subprocess
import sys
from pathlib import Path

SEEDS = (1, 2, 3)
COLD_PASSES = 5
STEADY_PASSES = 150


def cold(passes: int) -> None:
    from loadtest.bench_scheduler import make_action
    from managers.counted import CountedUnitsManager
    from tangram.sched.durations import DurationModel
    from tangram.sched.queue import FCFSQueue
    from tangram.sched.scheduler import Scheduler

    for seed in SEEDS:
        rng = random.Random(seed)
        manager = CountedUnitsManager({"cpu": {f"node{i}": 256 for i in range(5)},
                                       "memory_mb": {f"node{i}": 1 << 20 for i in range(5)}})
        queue = FCFSQueue()
        for seq in range(2048):
            queue.push(make_action(seq, 0.0, rng))
        for _ in range(passes):  # the queue is only read: each pass is the cold one
            Scheduler([manager], DurationModel(), depth=2, horizon=64).schedule(queue, iter([]), 0.0)


def steady(passes: int, resize: bool) -> None:
    from loadtest.bench_scheduler import run

    run(2048, passes, 5, 256, 1, 2, 64, resize, False)


def counted(tree: Path, arguments: list[str]) -> int:
    """Instructions of this script run on ``tree``'s code with ``arguments``, under Cachegrind (the script itself
    need not be in ``tree``: a baseline from before it counts as well)."""
    command = ["setarch", "-R", "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               sys.executable, str(Path(__file__).resolve()), "--inner", *arguments]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)})
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in Valgrind's output:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path.cwd(), help="the source tree to count (default: here)")
    parser.add_argument("--steady", action="store_true", help="steady-state passes instead of the cold one")
    parser.add_argument("--resize", action="store_true", help="with --steady: malleable actions")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--passes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        gc.disable()  # a collection's timing depends on what ran before: not part of the count
        if args.steady:
            steady(args.passes, args.resize)
        else:
            cold(args.passes)
        return
    kind = ["--steady"] + (["--resize"] if args.resize else []) if args.steady else []
    if args.steady:
        more, fewer, passes = STEADY_PASSES + 2, 2, STEADY_PASSES
    else:
        more, fewer, passes = COLD_PASSES, 0, COLD_PASSES * len(SEEDS)
    difference = counted(args.tree, [*kind, "--passes", str(more)]) - counted(args.tree, [*kind, "--passes", str(fewer)])
    name = ("steady, malleable" if args.resize else "steady") if args.steady else "cold"
    print(f"{args.tree}: {difference / passes / 1e6:.2f} M instructions per {name} pass")


if __name__ == "__main__":
    main()
