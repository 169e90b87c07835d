"""What fencing the leader's store costs (issue 17), on a real PostgreSQL store.

The same durable writes go to a plain store and to one fenced by a leader's epoch (one more statement per write
transaction), in alternating rounds: ``--batch`` concurrent submitters (their records share a group commit), then
``--sequential`` writes one after another (a commit each). Prints the time per action of each, and fenced/plain.

    python -m loadtest.bench_fence --url postgresql+asyncpg://... [--rounds 5] [--batch 64] [--sequential 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from tangram.core.action import Action
from tangram.leadership import Leadership, fence
from tangram.parse import parse_action
from tangram.store.store import Store


def action(seq: int) -> Action:
    made = parse_action({"task": "bench-fence", "kind": "exec", "demand": {"cpu": 1}})
    made.seq = seq
    return made


async def round_of(store: Store, batches: int, batch: int, sequential: int, seq: int) -> tuple[float, float]:
    """Seconds per action written concurrently, and one after another."""
    started = time.perf_counter()
    for i in range(batches):
        await asyncio.gather(*(store.durable(action(seq + i * batch + j)) for j in range(batch)))
    concurrent = (time.perf_counter() - started) / (batches * batch)
    started = time.perf_counter()
    for i in range(sequential):
        await store.durable(action(seq + batches * batch + i))
    return concurrent, (time.perf_counter() - started) / sequential


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("TANGRAM_TEST_PG_URL"), help="a PostgreSQL store URL")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sequential", type=int, default=200)
    args = parser.parse_args()
    if not args.url:
        parser.error("--url (or TANGRAM_TEST_PG_URL) names the PostgreSQL store")
    leadership = await Leadership.open(args.url, "http://bench-fence")
    await asyncio.wait_for(leadership.acquire(), 30)
    assert leadership.epoch is not None
    stores = {"plain": await Store.open(args.url), "fenced": await Store.open(args.url, fence=fence(leadership.epoch))}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in stores}
    seq = int(time.time() * 1000) << 8  # above any earlier run's
    try:
        for round_number in range(args.rounds):
            order = list(stores) if round_number % 2 == 0 else list(reversed(stores))  # alternate A and B
            for name in order:
                figures[name].append(await round_of(stores[name], args.batches, args.batch, args.sequential, seq))
                seq += args.batches * args.batch + args.sequential
    finally:
        for store in stores.values():
            await store.close()
        await leadership.close()
    for name, rows in figures.items():
        print(f"{name:6}  concurrent us/action {[round(c * 1e6) for c, _ in rows]}  "
              f"sequential ms/action {[round(s * 1e3, 2) for _, s in rows]}")
    medians = {name: (statistics.median(c for c, _ in rows), statistics.median(s for _, s in rows))
               for name, rows in figures.items()}
    print(f"fenced/plain (medians): concurrent {medians['fenced'][0] / medians['plain'][0]:.2f}, "
          f"sequential {medians['fenced'][1] / medians['plain'][1]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
