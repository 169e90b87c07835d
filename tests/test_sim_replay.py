"""Real-mode replay: a tiny compressed trace sent to a real broker on a real Docker engine, and compared with the
simulator's prediction for the same trace."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import defaultdict

import pytest

from tangram.core.action import Kind
from tangram.sim.cluster import Cluster
from tangram.sim.records import CallRecord
from tangram.sim.replay import action_body, command_for, compare, main, replay
from tangram.sim.trace import Call, Trace, Trajectory
from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import live_broker

EFFICIENCY = ((1, 1.0), (2, 0.9), (4, 0.8))


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


def two_cores(engine: str) -> dict:
    return cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "numa": ["0-1"],
                              "memory_mb": 4096}})


def tiny_trace() -> Trace:
    """4 trajectories: a few tool calls of 0.05-0.2 s, then an elastic test run of 0.4 s on one core."""
    trajectories = []
    for i in range(4):
        calls = [Call("tool", 0.02 + 0.01 * i, 0.05 + 0.05 * ((i + j) % 3)) for j in range(2 + i % 2)]
        calls.append(Call("test", 0.03, 0.4, efficiency=EFFICIENCY, estimate_s=0.4))
        trajectories.append(Trajectory(f"replay-{i}", "replay-test", 0.01 * i, tuple(calls), memory_mb=256))
    return Trace("tiny", 1, {}, trajectories)


def by_trajectory(records: list[CallRecord]) -> dict[str, list[CallRecord]]:
    rows: dict[str, list[CallRecord]] = defaultdict(list)
    for record in records:
        rows[record.trajectory].append(record)
    return {t: sorted(r, key=lambda x: x.index) for t, r in rows.items()}


def test_actions_have_the_shape_a_client_sends():
    trajectory = tiny_trace().trajectories[0]
    tool, test = trajectory.calls[0], trajectory.calls[-1]
    body = action_body(trajectory, tool, 2, timeout_s=60.0)
    assert body["demand"] == {"cpu": 1} and body["kind"] == "exec" and "elasticity" not in body
    assert body["trajectory"] == "replay-0" and body["task"] == "replay-test"
    body = action_body(trajectory, test, 2, timeout_s=60.0)
    assert body["demand"] == {"cpu": {"min": 1, "max": 2}}
    assert body["elasticity"] == {"resource": "cpu", "efficiency": {"1": 1.0, "2": 0.9, "4": 0.8}, "t1": 0.4}
    assert command_for(test)[-1] == "1:1.0,2:0.9,4:0.8"
    with pytest.raises(ValueError, match="reward"):
        action_body(trajectory, Call("reward", 0.1, 1.0, "judge"), 2, timeout_s=60.0)


async def test_a_reward_call_is_refused_before_anything_is_sent():
    trace = tiny_trace()
    last = trace.trajectories[-1]
    trace.trajectories[-1] = Trajectory(last.id, last.task, last.start_s,
                                        last.calls + (Call("reward", 0.1, 1.0, "judge"),))
    # nothing listens on port 9: any request would fail with a connection error, not a ValueError
    with pytest.raises(ValueError, match="'reward'"):
        await replay(trace, "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="'reward'"):
        await compare(trace, "http://127.0.0.1:9", Cluster(cpu_nodes=1, cores_per_node=2))


async def test_tiny_trace_replays_end_to_end_and_compares_with_the_simulator(db):
    engine = docker_engines()[0]
    trace = tiny_trace()
    async with live_broker(two_cores(engine), db) as live:
        result = await replay(trace, live.url, session=live.http)
        records = result.records
        # every call ran once and succeeded
        assert len(records) == trace.calls
        assert len({(r.trajectory, r.index) for r in records}) == trace.calls
        assert not [r for r in records if r.failed], records
        finished = [a for a in live.broker.recent if a.kind is Kind.EXEC]
        assert len(finished) == trace.calls  # the idempotency keys kept every call to one action
        rows = by_trajectory(records)
        for trajectory in trace.trajectories:
            mine = rows[trajectory.id]
            assert [r.index for r in mine] == list(range(len(trajectory.calls)))
            for before, after in itertools.pairwise(mine):  # a trajectory's calls are sequential
                assert before.finish_s <= after.submit_s
                assert after.submit_s - before.finish_s >= trajectory.calls[after.index].think_s * 0.9
            for record, call in zip(mine, trajectory.calls):
                assert record.submit_s <= record.start_s <= record.finish_s
                assert record.pool == "n1"
                assert math.isclose(record.act_s, record.queue_s + record.exec_s + record.overhead_s, abs_tol=1e-6)
                if call.kind == "tool":
                    assert record.units == 1
                    assert record.exec_s >= 0.8 * call.work_s  # the busy loop really burned its CPU time
                else:
                    assert 1 <= record.units <= 2
                    assert record.exec_s >= 0.8 * call.duration(record.units)
        assert result.stats["client_rtt_s_mean"] >= 0.0
        assert result.stats["environments_deleted"] == len(trace.trajectories)
        manager = live.broker.executor[Kind.EXEC]
        assert not manager.environments  # every trajectory's sandbox was deleted after its last call

        comparison = await compare(trace, live.url, session=live.http)
        sim, real = comparison["simulated"], comparison["real"]
        assert sim["calls"] == real["calls"] == trace.calls
        assert sim["failed_calls"] == real["failed_calls"] == 0
        assert set(sim["by_kind"]) == set(real["by_kind"]) == {"tool", "test"}
        for ratio in comparison["ratio_real_over_sim"].values():
            assert ratio is not None and math.isfinite(ratio) and ratio > 0


async def test_cli_prints_both_summaries(db, tmp_path, capsys):
    engine = docker_engines()[0]
    async with live_broker(two_cores(engine), db) as live:
        out = tmp_path / "out.json"
        # main() runs its own event loop: run it in a thread while this loop serves the broker
        code = await asyncio.to_thread(main, ["--url", live.url, "--batch", "2", "--compress", "40", "--turns",
                                              "2", "--memory-mb", "256", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "mean_trajectory_act_s" in printed and "real/simulated" in printed
    assert out.exists()
