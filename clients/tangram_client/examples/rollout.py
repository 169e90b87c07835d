"""An agentic coding rollout against a broker: the shape of a verl or custom RL loop, without the model.

Each trajectory gets a sandbox (on its first ``exec``), writes a small buggy project into it, "thinks" (a sleep
standing for LLM generation, holding a unit of ``lease.local`` as a stand-in for a rate-limited generation slot),
runs its tests, patches the bug, and runs the tests again as an elastic action; the reward is whether they pass.
At the end the trajectory's sandbox is deleted.

    bash scripts/serve.sh &                        # a broker on embedded defaults
    .venv/bin/python -m tangram_client.examples.rollout --trajectories 8  # needs rich (the broker's install has it)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from tangram_client import ActionRecord, AsyncTangramClient, TangramError

PROJECT = {
    "calc.py": "def mean(values):\n    return sum(values) / (len(values) + 1)  # the bug to fix\n",
    "test_calc.py": ("import unittest\nfrom calc import mean\n\n\nclass MeanTest(unittest.TestCase):\n"
                     "    def test_mean(self):\n        self.assertEqual(mean([1, 2, 3]), 2)\n\n"
                     "    def test_single(self):\n        self.assertEqual(mean([5]), 5)\n\n\n"
                     "if __name__ == '__main__':\n    unittest.main()\n"),
}
PATCH = "python3 -c \"import pathlib; p = pathlib.Path('calc.py'); p.write_text(p.read_text().replace(' + 1', ''))\""
TESTS = "python3 -m unittest -q test_calc 2>&1; echo exit=$?"
#: how the test run speeds up with cores (the broker picks the count); t1 is learned after the first runs
ELASTIC_TESTS = {"resource": "cpu", "efficiency": {"1": 1.0, "2": 0.9, "4": 0.7}}


@dataclass
class Trajectory:
    name: str
    reward: float = 0.0
    actions: list[ActionRecord] = field(default_factory=list)
    error: str | None = None

    @property
    def act_s(self) -> float:
        return sum(a.timings.get("act_s") or 0.0 for a in self.actions)


async def think(client: AsyncTangramClient, seconds: float) -> None:
    """LLM generation stands here: hold one generation slot (a lease) while 'generating'."""
    async with client.leased({"lease.local": 1}, ttl_s=60):
        await asyncio.sleep(seconds)


async def rollout(client: AsyncTangramClient, trajectory: Trajectory, rng: random.Random, think_s: float) -> None:
    def step(record: ActionRecord) -> ActionRecord:
        trajectory.actions.append(record)
        return record

    try:
        step(await client.exec("ls", trajectory=trajectory.name, files=PROJECT, memory_mb=256))
        await think(client, rng.uniform(0.5, 1.5) * think_s)
        before = step(await client.exec(TESTS, trajectory=trajectory.name))
        await think(client, rng.uniform(0.5, 1.5) * think_s)
        step(await client.exec(PATCH, trajectory=trajectory.name))
        after = step(await client.exec(TESTS, trajectory=trajectory.name, cores=(1, 4), elasticity=ELASTIC_TESTS,
                                       signature="unit-tests"))
        trajectory.reward = 1.0 if "exit=0" in after.result["stdout"] and "exit=0" not in before.result["stdout"] \
            else 0.0
    except TangramError as error:
        trajectory.error = str(error)
    finally:
        for env in await client.environments():
            if env["trajectory"] == trajectory.name:
                await client.delete_environment(env["id"])


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8300")
    parser.add_argument("--task", default="example-rollout")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--think-s", type=float, default=1.0, help="mean 'generation' time between actions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    console = Console()
    rng = random.Random(args.seed)
    run_id = f"{int(time.time())}-{rng.randrange(1 << 16):04x}"
    trajectories = [Trajectory(f"traj-{run_id}-{i:03d}") for i in range(args.trajectories)]
    started = time.perf_counter()
    async with AsyncTangramClient(args.url, task=args.task) as client:
        try:
            await client.health()
        except TangramError as error:
            console.print(f"[red]no broker at {args.url}: {error}[/red] (start one with `bash scripts/serve.sh`)")
            return 1
        await asyncio.gather(*(rollout(client, t, random.Random(rng.random()), args.think_s) for t in trajectories))
    wall = time.perf_counter() - started
    table = Table(title=f"{args.trajectories} trajectories of task {args.task!r} in {wall:.1f} s")
    for column in ("trajectory", "reward", "actions", "ACT (sum)", "cores of the last test run", "error"):
        table.add_column(column)
    for t in trajectories:
        cores = t.actions[-1].result.get("cores") if len(t.actions) == 4 else None
        table.add_row(t.name, f"{t.reward:.1f}", str(len(t.actions)), f"{t.act_s:.2f} s", str(cores or "-"),
                      t.error or "")
    console.print(table)
    console.print(f"mean reward {sum(t.reward for t in trajectories) / len(trajectories):.2f}; "
                  f"watch the broker at {args.url}/ui or with `tangram status --url {args.url}`")
    return 0 if all(t.error is None for t in trajectories) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
