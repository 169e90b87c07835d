"""GPU scheduling-pass benchmark: elastic reward actions (DoP 1/2/4/8) over 5 nodes x 8 GPUs, 10 services.

The same queue is scheduled twice per size: by the GPU manager (buddy chunks; the DP walks the chunk operator's
states) and, as the baseline, by plain counted units in the same pools (the vectorized Basic DP, which knows no
topology). Prints the median pass time of each and their ratio, and the units the GPU pass granted.

    python -m loadtest.bench_gpu_scheduler [--queues 8,64,512,2048] [--reps 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter

from managers.counted import CountedUnitsManager
from managers.gpu.config import parse_gpu_config
from managers.gpu.manager import GpuManager
from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.seam import ResourceManager
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Placement, Scheduler

NODES, GPUS, SERVICES = 5, 8, 10


def gpu_manager() -> GpuManager:
    """Torch services that are never prepared: the pass only reads chunks and residency."""
    service = {"backend": "torch", "model": "unused", "dops": [1, 2, 4, 8], "gpu_memory_mb": 1000,
               "host_memory_mb": 1}
    return GpuManager(parse_gpu_config({
        "nodes": {f"n{i}": {"gpus": GPUS, "gpu_memory_mb": 80000, "host_memory_mb": 10**6, "device_type": "cpu"}
                  for i in range(NODES)},
        "services": {f"s{i}": service for i in range(SERVICES)}}))


def queue(size: int, rng: random.Random) -> list[Action]:
    actions = []
    for seq in range(size):
        decay = rng.uniform(0.02, 0.1)
        efficiency = tuple((m, max(0.3, 1.0 - decay * (m - 1))) for m in (1, 2, 4, 8))
        action = Action(task="bench", kind=Kind.REWARD, demands={"gpu": Demand((1, 2, 4, 8))},
                        elasticity=Elasticity("gpu", efficiency, t1=rng.lognormvariate(2.0, 0.8)),
                        spec={"service": f"s{rng.randrange(SERVICES)}", "input": {"pairs": [["", ""]]}})
        action.seq = seq
        actions.append(action)
    return actions


def timed(manager: ResourceManager, actions: list[Action], reps: int) -> tuple[float, list[Placement]]:
    scheduler = Scheduler([manager], DurationModel(), depth=2, horizon=64)
    times, placements = [], []
    for _ in range(reps):
        started = time.perf_counter()
        placements = scheduler.schedule(actions, [], now=0.0).placements
        times.append(time.perf_counter() - started)
    return statistics.median(times), placements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", default="8,64,512,2048", help="queue lengths to schedule")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"{'queued':>7} {'chunk DP ms':>12} {'basic DP ms':>12} {'ratio':>6}  GPUs granted per action (count)")
    for size in (int(n) for n in args.queues.split(",")):
        actions = queue(size, rng)
        chunk_s, placements = timed(gpu_manager(), actions, args.reps)
        basic_s, _ = timed(CountedUnitsManager({"gpu": {f"n{i}": GPUS for i in range(NODES)}}), actions, args.reps)
        granted = dict(sorted(Counter(p.units["gpu"] for p in placements).items()))
        print(f"{size:>7} {chunk_s * 1e3:>12.2f} {basic_s * 1e3:>12.2f} {chunk_s / basic_s:>6.2f}  {granted}")


if __name__ == "__main__":
    main()
