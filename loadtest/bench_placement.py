"""GPU placement benchmark: the ILP (HiGHS) against the greedy and the type-blind baseline on random mixed clusters.

Each instance draws its GPU types from the shipped ones (``managers/gpu/gpu_types.py``, not ``cpu``), spreads its nodes
(8 GPUs each, at least one per type) over them, and draws services: model sizes log-uniform over 1-140 GB, the
smallest DoP whose share of the weights (x1.3 for activations) fits 80 GB, half of them generating (memory-bound),
loads log-normal summing to about half the cluster's reference capacity. Each node's host memory holds a share of
all host copies: 1.0 is today's GPU manager (every node holds every copy), 0.4 makes host memory decide where
variants go. Prints, per size and share, the ILP's solve time (median, max), how far the greedy's and the
type-blind placement's ``t`` fall below the ILP's (ILP / other: median, worst), the variants each keeps on average,
and how often the ILP fell back.

    python -m loadtest.bench_placement [--sizes 10x4x5,20x6x16] [--host 1.0,0.4] [--seeds 1-10] [--time-limit 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from managers.gpu.gpu_types import GPU_TYPES
from managers.gpu.placement import place, place_greedy, place_type_blind
from managers.gpu.placement_problem import NodeGroup, ServiceLoad

GPUS_PER_NODE = 8
#: the types an instance draws from
TYPES = tuple(name for name in GPU_TYPES if name != "cpu")


def instance(rng: random.Random, services: int, types: int, nodes: int,
             host_share: float) -> tuple[list[ServiceLoad], list[NodeGroup]]:
    """One random cluster and service mix (see the module's docstring)."""
    names = rng.sample(TYPES, types)
    per_type = [1] * types
    for _ in range(nodes - types):
        per_type[rng.randrange(types)] += 1
    loads = []
    for i in range(services):
        size_mb = 1024 * 10 ** rng.uniform(0, 2.15)
        dop = next(d for d in (1, 2, 4, 8) if 1.3 * size_mb / d <= 80 * 1024)
        loads.append(ServiceLoad(f"s{i}", load=rng.lognormvariate(0, 1), host_memory_mb=size_mb,
                                 gpu_memory_mb=1.3 * size_mb / dop, bound=rng.choice(("compute", "memory"))))
    capacity = nodes * GPUS_PER_NODE
    total = sum(s.load for s in loads)
    loads = [ServiceLoad(s.name, s.load * 0.5 * capacity / total, s.host_memory_mb, s.gpu_memory_mb, s.bound)
             for s in loads]
    host = max(host_share * sum(s.host_memory_mb for s in loads), max(s.host_memory_mb for s in loads))
    groups = [NodeGroup(name, GPU_TYPES[name], gpus=n * GPUS_PER_NODE, host_memory_mb=host)
              for name, n in zip(names, per_type)]
    return loads, groups


def run(size: tuple[int, int, int], host_share: float, seeds: list[int], time_limit_s: float) -> dict[str, Any]:
    """The figures of one size and host memory share over ``seeds``."""
    solve, greedy, blind, variants = [], [], [], {"ilp": 0, "greedy": 0, "type-blind": 0}
    fallbacks = 0
    for seed in seeds:
        services, groups = instance(random.Random(seed), *size, host_share)
        ilp = place(services, groups, time_limit_s=time_limit_s)
        others = place_greedy(services, groups), place_type_blind(services, groups)
        solve.append(ilp.solve_s)
        fallbacks += ilp.method != "ilp"
        greedy.append(ilp.objective / others[0].objective)
        blind.append(ilp.objective / others[1].objective)
        for result in (ilp, *others):
            variants[result.method] += result.variant_count
    return {"solve_median_s": statistics.median(solve), "solve_max_s": max(solve),
            "greedy_median": statistics.median(greedy), "greedy_worst": max(greedy),
            "blind_median": statistics.median(blind), "blind_worst": min(blind),
            "variants": {method: count / len(seeds) for method, count in variants.items()}, "fallbacks": fallbacks}


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10x4x5,20x6x16", help="services x types x nodes, comma-separated")
    parser.add_argument("--host", default="1.0,0.4", help="each node's host memory, as shares of all host copies")
    parser.add_argument("--seeds", default="1-10", help="a seed or a range of them")
    parser.add_argument("--time-limit", type=float, default=2.0, help="the ILP's time limit, seconds")
    args = parser.parse_args()
    seeds = _seeds(args.seeds)
    print(f"{'size':>9} {'host':>4} {'ILP s med':>9} {'max':>6} {'ILP/greedy med':>14} {'worst':>6} "
          f"{'ILP/blind med':>13} {'least':>6}  variants ilp/greedy/blind  fallbacks")
    for text, host in ((t, float(h)) for t in args.sizes.split(",") for h in args.host.split(",")):
        services, types, nodes = (int(n) for n in text.split("x"))
        f = run((services, types, nodes), host, seeds, args.time_limit)
        v = f["variants"]
        print(f"{text:>9} {host:>4.2g} {f['solve_median_s']:>9.3f} {f['solve_max_s']:>6.3f} {f['greedy_median']:>14.3f} "
              f"{f['greedy_worst']:>6.3f} {f['blind_median']:>13.2f} {f['blind_worst']:>6.2f}  "
              f"{v['ilp']:.1f}/{v['greedy']:.1f}/{v['type-blind']:.1f}  {f['fallbacks']}/{len(seeds)}")


if __name__ == "__main__":
    main()
