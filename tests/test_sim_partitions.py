"""Broker partitions by task in the simulator (issue 40): one partition is one broker, a static partition keeps to
its slice, the shared view never gives a core twice, and each partition's queue stays FCFS."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import defaultdict
from functools import partial
from itertools import pairwise

import pytest

from tangram.sched.profile import DEFAULT_PROFILE
from tangram.sim.cluster import Cluster
from tangram.sim.engine import Policy, simulate
from tangram.sim.partition_scenario import SETTINGS, designs, imbalance
from tangram.sim.partitions import partition_of, shared_partitions, static_partitions
from tangram.sim.policies import broker
from tangram.sim.records import CallRecord, RunResult
from tangram.sim.task_mix import TaskMix, coding_tasks, task_name
from tangram.sim.trace import Trace
from tangram.sim.workloads import CodingParams

#: two nodes of 30 cores under 72 trajectories of six tasks: the test runs grow into every idle core, so a slice
#: (or the cluster) is full at times
CLUSTER = Cluster(cpu_nodes=2, cores_per_node=30)
MIX = TaskMix(tasks=6, skew=1.0)
#: the partitioned designs: P -> policy
DESIGNS = {"static": partial(static_partitions, DEFAULT_PROFILE), "shared": partial(shared_partitions, DEFAULT_PROFILE),
           "lending": partial(shared_partitions, DEFAULT_PROFILE, lend=True)}


def trace(seed: int = 1) -> Trace:
    return coding_tasks(MIX, CodingParams(batch=72, turns_median=6.0), seed)


def run(policy: Policy, seed: int = 1) -> RunResult:
    return simulate(trace(seed), CLUSTER, policy, "partitions")


def max_overlap(records: list[CallRecord]) -> int:
    """The most units the records hold at one instant (an end at an instant gives back before a start takes)."""
    events = sorted((t, 0 if units < 0 else 1, units) for r in records for start, end, held in r.holding()
                    for t, units in ((start, held), (end, -held)))
    held = peak = 0
    for _, _, units in events:
        held += units
        peak = max(peak, held)
    return peak


def by_partition(result: RunResult, partitions: int) -> dict[int, list[CallRecord]]:
    tasks = {t.id: t.task for t in trace().trajectories}
    out: dict[int, list[CallRecord]] = defaultdict(list)
    for record in result.records:
        out[partition_of(tasks[record.trajectory], partitions)].append(record)
    return out


@pytest.mark.parametrize("design", sorted(DESIGNS))
def test_one_partition_is_exactly_one_broker(design):
    one = [dataclasses.astuple(r) for r in run(broker(DEFAULT_PROFILE)).records]
    assert [dataclasses.astuple(r) for r in run(DESIGNS[design](1)).records] == one


def test_a_static_partition_never_holds_more_than_its_slice_and_fills_it():
    partitions = 3
    share = CLUSTER.cores_per_node // partitions  # 10 cores of each node
    result = run(static_partitions(DEFAULT_PROFILE, partitions))
    peaks = []
    for records in by_partition(result, partitions).values():
        for node in {r.pool for r in records}:
            peaks.append(max_overlap([r for r in records if r.pool == node]))
    assert max(peaks) == share  # the slice binds: its test runs would grow past it


@pytest.mark.parametrize("design", ["shared", "lending"])
def test_the_shared_view_never_gives_a_core_twice_and_lends_past_a_slice(design):
    partitions = 3
    result = run(DESIGNS[design](partitions))
    for node in {r.pool for r in result.records}:
        assert max_overlap([r for r in result.records if r.pool == node]) <= CLUSTER.cores_per_node
    assert max_overlap(result.records) == CLUSTER.cores
    # some partition held more than a static slice of the cluster at once: the capacity is shared
    assert max(max_overlap(records) for records in by_partition(result, partitions).values()) \
        > CLUSTER.cores // partitions


@pytest.mark.parametrize("design", sorted(DESIGNS))
def test_tool_calls_start_in_submission_order_within_a_partition(design):
    """Alg. 1's FCFS per resource within each partition's queue: a one-core tool call never overtakes an earlier
    one of its partition (test runs may: a malleable share can leave a queued one at zero cores)."""
    partitions = 3
    for records in by_partition(run(DESIGNS[design](partitions)), partitions).values():
        assert inversions(records) == 0


def inversions(records: list[CallRecord]) -> int:
    """Tool calls that started before one submitted earlier: FCFS broken."""
    tools = sorted((r for r in records if r.kind == "tool"), key=lambda r: (r.submit_s, r.start_s))
    return sum(a.start_s > b.start_s for a, b in pairwise(tools))


def test_only_lending_keeps_one_brokers_order_between_partitions():
    """One broker lends a test run's cores above its floor to a tool call, so none waits. Static slices, and a shared
    view of free cores alone, leave one partition's tool calls waiting behind cores another holds (its slice, or
    its grown test runs), and calls of different partitions start out of their order; lending does not."""
    assert inversions(run(broker(DEFAULT_PROFILE)).records) == 0
    assert inversions(run(DESIGNS["lending"](3)).records) == 0
    for design in ("static", "shared"):
        result = run(DESIGNS[design](3))
        assert inversions(result.records) > 0
        assert max(r.queue_s for r in result.records if r.kind == "tool") > 1.0


def test_every_call_of_a_task_is_served_by_the_partition_its_name_hashes_to():
    assert partition_of("task0", 4) == int.from_bytes(hashlib.blake2b(b"task0", digest_size=8).digest(), "big") % 4
    assert {partition_of(task_name(k, 1), 3) for k in range(16)} == {0, 1, 2}
    assert imbalance(trace(), 1) == 1.0
    assert 1.0 <= imbalance(trace(), 4) <= 4.0


def test_task_batches_split_the_whole_by_zipf():
    assert TaskMix(4, 0.0).batches(10) == [3, 3, 2, 2]
    skewed = TaskMix(16, 1.0).batches(1280)
    assert sum(skewed) == 1280 and skewed == sorted(skewed, reverse=True) and skewed[0] > 3 * skewed[3]
    assert {t.task for t in coding_tasks(TaskMix(3, 0.0), CodingParams(batch=9), 1).trajectories} == \
        {"s1-task0", "s1-task1", "s1-task2"}
    with pytest.raises(ValueError):
        TaskMix(0, 1.0)


def test_the_scenario_compares_every_design_on_every_mix():
    assert list(designs(DEFAULT_PROFILE)) == ["tangram", *(f"{design}-{p}" for design in ("static", "shared", "lending")
                                                           for p in (2, 3, 4))]
    assert len(set(SETTINGS)) == len(SETTINGS)


def test_partitions_refuse_a_cluster_with_gpus():
    with pytest.raises(ValueError, match="CPU clusters"):
        shared_partitions(DEFAULT_PROFILE, 2)(Cluster(cpu_nodes=1, gpu_node_sizes=(8,)))


@pytest.mark.parametrize("partitions", [2, 3, 4])
def test_lending_carries_out_every_plan_while_partitions_resize_each_others_runs(partitions):
    """A pass that resizes another partition's test runs leaves that partition's last shares stale: it shares its
    pools afresh at its next pass, or that pass counts cores that are gone and the manager refuses the plan."""
    tight = Cluster(cpu_nodes=2, cores_per_node=16)
    result = simulate(trace(), tight, DESIGNS["lending"](partitions), "lending")
    assert len(result.records) == trace().calls
    for node in {r.pool for r in result.records}:
        assert max_overlap([r for r in result.records if r.pool == node]) <= tight.cores_per_node


@pytest.mark.slow
@pytest.mark.timeout(1200)  # fifty simulations at --scale 0.2: past the suite's 300 s on a busy machine
def test_the_scenario_writes_every_designs_figures_json_and_a_png(tmp_path):
    from tangram.cli import main
    from tests.test_simulate_cli import QUICK, check_written

    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["simulate", "partitions", "--scale", QUICK, "--json", str(out_json), "--plot", str(out_png)]) == 0
    body = json.loads(out_json.read_text())
    check_written(body, "partitions", out_png)
    assert {p["policy"] for p in body["points"]} == set(designs(DEFAULT_PROFILE))
    assert {p["x"] for p in body["points"]} == set(range(len(SETTINGS)))
    ratios = {f["name"]: f["ours"] for f in body["figures"]}
    for x in range(len(SETTINGS)):
        label = next(note.partition(": ")[2] for note in body["notes"] if note.startswith(f"x = {x}: "))
        assert ratios[f"busiest partition / even share, P = 4, {label}"] >= 1.0
        assert ratios[f"static-4 / one broker: mean ACT per trajectory, {label}"] > 1.0
