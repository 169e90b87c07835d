"""The trace-driven simulator (tangram/sim): determinism, conservation laws on every policy, and small cases whose
times are computed by hand for the broker and for each baseline.

Hand cases build traces call by call; expected figures are derived in the comments next to each assertion.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

from managers.cpu.exec_spec import PytestRunner
from tangram.core.action import Demand
from tangram.sched.cycle import Cycle
from tangram.sched.profile import DEFAULT_PROFILE, ElasticArgs, HrrsArgs
from tangram.sim import policies, workloads
from tangram.sim.broker_station import ELASTIC_TEST, BrokerStation
from tangram.sim.cluster import ApiModel, Cluster, Costs, ServiceModel, StaticServing, startup_cpu_s
from tangram.sim.engine import Policy, simulate
from tangram.sim.records import CallRecord, RunResult
from tangram.sim.trace import Call, Trace, Trajectory
from tangram.sim.workloads import GPU_EFFICIENCY, CodingParams, MopdParams, SearchParams, teacher_names

POD_POLICIES = ("baseline", "pods-ideal")
BROKER_POLICIES = tuple(p for p in policies.POLICIES if p not in POD_POLICIES)  # every call through the broker
EPS = 1e-9

# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def hand_trace(*trajectories: Trajectory) -> Trace:
    return Trace("hand", 0, {}, list(trajectories))


def one_call(tid: str, call: Call, start_s: float = 0.0) -> Trajectory:
    return Trajectory(tid, "task", start_s, (call,))


def run(trace: Trace, cluster: Cluster, policy: str | Policy) -> RunResult:
    if isinstance(policy, str):
        return simulate(trace, cluster, policies.POLICIES[policy], policy)
    return simulate(trace, cluster, policy, "custom")


def by_key(result: RunResult) -> dict[tuple[str, int], CallRecord]:
    return {(r.trajectory, r.index): r for r in result.records}


def tuples(result: RunResult) -> list[tuple[object, ...]]:
    return [dataclasses.astuple(r) for r in result.records]


def max_overlap(intervals: list[tuple[float, float, int]]) -> int:
    """The largest sum of weights held at once over half-open intervals ``[start, finish)``: at one instant a
    finish gives back before a start takes."""
    events = sorted([(s, 1, w) for s, _, w in intervals] + [(f, 0, -w) for _, f, w in intervals])
    held = peak = 0
    for _, _, delta in events:
        held += delta
        peak = max(peak, held)
    return peak


# ---------------------------------------------------------------------------------------------------------------
# small generated workloads and the cluster they share
# ---------------------------------------------------------------------------------------------------------------

SERVICES = tuple(ServiceModel(n, static_replicas=1, static_dop=2) for n in teacher_names(3)) + (
    ServiceModel("judge", static_replicas=1, static_dop=4),)
APIS = (ApiModel("api.search", quota=5, period_s=2.0, concurrency=3),
        ApiModel("api.fetch", quota=4, period_s=1.7, concurrency=2))
MIXED = Cluster(cpu_nodes=2, cores_per_node=16, gpu_node_sizes=(8, 4), services=SERVICES, apis=APIS)
#: the policies that can run on MIXED (a fixed DoP above its 16-core nodes could never start)
MIXED_POLICIES = sorted(p for p in policies.POLICIES if not (p.startswith("dop") and int(p[3:]) > 16))


def coding_trace(seed: int = 3) -> Trace:
    return workloads.ai_coding(CodingParams(batch=40), seed=seed)


def mopd_trace() -> Trace:
    return workloads.mopd(MopdParams(batch=60, teachers=3, think_median_s=5.0), seed=2)


def search_trace() -> Trace:
    return workloads.deepsearch(SearchParams(batch=30, turns_median=4.0, think_median_s=1.0), seed=2)


TRACES = {"coding": coding_trace, "mopd": mopd_trace, "search": search_trace,
          "mopd+search": lambda: workloads.merged("mopd+search", mopd_trace(), search_trace())}


# ---------------------------------------------------------------------------------------------------------------
# 1. determinism
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", MIXED_POLICIES)
def test_same_trace_same_records(policy: str) -> None:
    trace = coding_trace()
    cluster = Cluster(cpu_nodes=2, cores_per_node=16)
    first = run(trace, cluster, policy)
    second = run(coding_trace(), cluster, policy)  # a freshly generated trace from the same seed
    assert len(first.records) == trace.calls
    assert tuples(first) == tuples(second)


@pytest.mark.parametrize("policy", MIXED_POLICIES)
def test_mixed_trace_is_deterministic(policy: str) -> None:
    trace = TRACES["mopd+search"]()
    assert tuples(run(trace, MIXED, policy)) == tuples(run(trace, MIXED, policy))


def test_seed_changes_the_trace() -> None:
    assert coding_trace(3).to_json() == coding_trace(3).to_json()
    assert coding_trace(3).to_json() != coding_trace(4).to_json()
    assert workloads.mopd(MopdParams(batch=20), seed=1).to_json() != workloads.mopd(MopdParams(batch=20),
                                                                                     seed=2).to_json()
    assert workloads.deepsearch(SearchParams(batch=20), seed=1).to_json() != workloads.deepsearch(
        SearchParams(batch=20), seed=2).to_json()


@pytest.mark.slow  # seconds: left out of the fast lane
def test_trace_save_load_round_trip(tmp_path: Path) -> None:
    trace = workloads.merged("all", coding_trace(), mopd_trace(), search_trace())
    path = tmp_path / "trace.json"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded.to_json() == trace.to_json()
    assert loaded.trajectories == trace.trajectories  # tuples of calls, efficiency as tuples of pairs
    for policy in ("tangram", "baseline"):
        assert tuples(run(loaded, MIXED, policy)) == tuples(run(trace, MIXED, policy))


# ---------------------------------------------------------------------------------------------------------------
# 2. conservation on every policy
# ---------------------------------------------------------------------------------------------------------------


def check_calls_and_sequencing(trace: Trace, result: RunResult) -> None:
    keys = [(r.trajectory, r.index) for r in result.records]
    assert len(keys) == len(set(keys)), "a call was recorded twice"
    expected = {(t.id, i) for t in trace.trajectories for i in range(len(t.calls))}
    assert set(keys) == expected
    records = by_key(result)
    for t in trace.trajectories:
        previous_finish = t.start_s
        for i, call in enumerate(t.calls):
            r = records[(t.id, i)]
            assert (r.kind, r.target) == (call.kind, call.target)
            assert r.submit_s == previous_finish + call.think_s, (t.id, i)  # same float expression as the engine
            assert r.submit_s <= r.start_s + EPS and r.start_s <= r.finish_s, (t.id, i, r)
            assert r.exec_s >= 0 and r.overhead_s >= 0
            assert r.finish_s == pytest.approx(r.start_s + r.exec_s + r.overhead_s, abs=1e-6)
            previous_finish = r.finish_s


def check_broker_capacity(trace: Trace, result: RunResult, cluster: Cluster) -> None:
    calls = {(t.id, i): c for t in trace.trajectories for i, c in enumerate(t.calls)}
    cpu: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    gpu: dict[tuple[str, int], list[tuple[float, float, int]]] = defaultdict(list)
    api: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for r in result.records:
        call = calls[(r.trajectory, r.index)]
        assert not r.failed and r.attempts == 1
        if r.kind in ("tool", "test"):
            assert r.pool in {f"cpu{i}" for i in range(cluster.cpu_nodes)}
            assert 1 <= r.units <= cluster.cores_per_node
            if r.kind == "tool":
                assert r.units == 1 and not r.history
                assert r.exec_s == pytest.approx(call.duration(1), rel=1e-9, abs=1e-9)
            elif not r.history:  # the same cores throughout: its true duration there, plus its workers' start-up
                most = startup_cpu_s(cluster.costs, ELASTIC_TEST.max, call.work_s, follows=True) / r.units
                assert call.duration(r.units) * (1 - 1e-9) <= r.exec_s <= call.duration(r.units) + most + EPS
            else:  # resized: never faster than on the most cores it ever held
                assert r.exec_s >= call.duration(max(u for _, u in r.history)) * (1 - 1e-9)
                assert r.history[0] == (r.start_s, r.units) and r.resizes == len(r.history) - 1
            cpu[r.pool].extend(r.holding())
        elif r.kind == "reward":
            node, chunk = r.pool.split(":")
            start, size = map(int, chunk.split("+"))
            assert node.startswith("gpu") and size == r.units and start % size == 0  # a buddy chunk
            assert start + size <= cluster.gpu_node_sizes[int(node[3:])]
            assert r.exec_s == call.duration(r.units)
            for g in range(start, start + size):
                gpu[(node, g)].append((r.start_s, r.finish_s, 1))
        else:
            assert r.pool == r.target and r.units == 1
            assert r.exec_s == call.work_s and r.overhead_s == 0
            api[r.pool].append((r.start_s, r.finish_s, 1))
    for node, intervals in cpu.items():
        assert max_overlap(intervals) <= cluster.cores_per_node, node
    for (node, g), intervals in gpu.items():
        assert max_overlap(intervals) <= 1, f"{node} GPU {g} held by two calls at once"
    limits = {a.name: a for a in cluster.apis}
    for name, intervals in api.items():
        model = limits[name]
        assert max_overlap(intervals) <= model.concurrency, name
        starts = sorted(s for s, _, _ in intervals)
        for i, s in enumerate(starts):  # a grant at s counts in [s, s + period)
            in_window = sum(1 for t in starts[i:] if t < s + model.period_s - EPS)
            assert in_window <= model.quota, (name, s, in_window)


def check_baseline(trace: Trace, result: RunResult, cluster: Cluster) -> None:
    calls = {(t.id, i): c for t in trace.trajectories for i, c in enumerate(t.calls)}
    replicas: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    static = {s.name: s for s in cluster.services}
    for r in result.records:
        call = calls[(r.trajectory, r.index)]
        if r.kind in ("tool", "test"):
            cap = 4.0 if call.elastic else 1.0  # the pod's limit, or one core for a tool call
            assert r.exec_s >= call.duration(min(cap, cluster.cores_per_node)) * (1 - 1e-9)
            assert r.overhead_s <= cluster.costs.pod_start_s + EPS and not r.failed
        elif r.kind == "reward":
            assert r.units == static[str(r.target)].static_dop and r.overhead_s == 0 and not r.failed
            assert r.exec_s >= call.duration(r.units) * (1 - 1e-9)  # alone, or slowed by its batch
            replicas[r.pool].append((r.start_s, r.finish_s, 1))
        else:
            assert 1 <= r.attempts <= cluster.costs.api_retries + 1
            assert r.failed or r.exec_s == pytest.approx(call.work_s)  # finish - start of the last attempt
    for pool, intervals in replicas.items():
        assert max_overlap(intervals) <= cluster.static.batch, f"static replica {pool} over its batch"


@pytest.mark.parametrize("workload", sorted(TRACES))
@pytest.mark.parametrize("policy", MIXED_POLICIES)
def test_conservation(workload: str, policy: str) -> None:
    trace = TRACES[workload]()
    result = run(trace, MIXED, policy)
    check_calls_and_sequencing(trace, result)
    if policy in BROKER_POLICIES:
        check_broker_capacity(trace, result, MIXED)
    else:
        check_baseline(trace, result, MIXED)


def test_conservation_cases_are_contended() -> None:
    """The capacity checks above bind: cores run out, GPUs are shared by services, quotas make calls wait."""
    coding = run(coding_trace(), MIXED, "tangram")
    peak = max(max_overlap([i for r in coding.records if r.pool == node for i in r.holding()])
               for node in ("cpu0", "cpu1"))
    assert peak == MIXED.cores_per_node
    assert sum(r.resizes for r in coding.records) > 0  # test runs were shrunk for tool calls and grown back
    mixed = run(TRACES["mopd+search"](), MIXED, "tangram")
    assert mixed.stats["evictions"] > 0
    assert any(r.queue_s > 0 for r in mixed.records if r.kind == "api")
    direct = run(search_trace(), MIXED, "baseline")
    assert direct.stats["api_errors"] + direct.stats["api_timeouts"] > 0


# ---------------------------------------------------------------------------------------------------------------
# 3. hand-computed cases: pods
# ---------------------------------------------------------------------------------------------------------------

POD_COSTS = Costs(pod_start_s=1.0, pod_bind_per_s=10.0)  # a pod bound every 0.1 s, running 1 s after its bind


def test_pods_bind_in_turn_and_share_cores() -> None:
    cluster = Cluster(cpu_nodes=1, cores_per_node=2, costs=POD_COSTS)
    trace = hand_trace(*(one_call(f"t{i}", Call("tool", 0.0, 2.0)) for i in range(3)))
    result = run(trace, cluster, "baseline")
    r = by_key(result)
    # Binds at 0, 0.1, 0.2; pods run at 1.0, 1.1, 1.2 (queue = bind wait, overhead = pod start).
    # 1.0-1.1: t0 alone on one core (a tool call uses one): t0 has 1.9 s left.
    # 1.1-1.2: t0 and t1 one core each: 1.8 and 1.9 left.
    # from 1.2: three calls share 2 cores, 2/3 each: t0 ends after 1.8 / (2/3) = 2.7 s, at 3.9;
    #   t1 then has 1.9 - 1.8 = 0.1 left, t2 2.0 - 1.8 = 0.2: one core each again: t1 ends at 4.0, t2 at 4.1.
    for tid, bind, finish in (("t0", 0.0, 3.9), ("t1", 0.1, 4.0), ("t2", 0.2, 4.1)):
        rec = r[(tid, 0)]
        assert rec.submit_s == 0.0
        assert rec.start_s == pytest.approx(bind) and rec.queue_s == pytest.approx(bind)
        assert rec.overhead_s == pytest.approx(1.0)
        assert rec.finish_s == pytest.approx(finish)
        assert rec.exec_s == pytest.approx(2.9)  # every call ran 2.9 s for 2 s of work on one core
        assert rec.pool == "cpu0" and rec.units == 1 and not rec.failed
    assert result.stats["pods_bound"] == 3 and result.stats["peak_pending_pods"] == 3


def test_pod_waits_for_room_on_the_node() -> None:
    # One core; each pod requests 0.5 CPU, so two pods fit and the third waits until a trajectory ends.
    cluster = Cluster(cpu_nodes=1, cores_per_node=1, costs=POD_COSTS)
    trace = hand_trace(*(one_call(f"t{i}", Call("tool", 0.0, 2.0)) for i in range(3)))
    r = by_key(run(trace, cluster, "baseline"))
    # t0 runs at 1.0 alone (1.9 left at 1.1); from 1.1 t0 and t1 share one core at 0.5 each:
    # t0 ends at 1.1 + 1.9 / 0.5 = 4.9; t1 has 0.1 left and ends alone at 5.0.
    assert r[("t0", 0)].finish_s == pytest.approx(4.9)
    assert r[("t1", 0)].finish_s == pytest.approx(5.0)
    # t0's pod is deleted at 4.9: t2's pod is bound then (queue 4.9), runs at 5.9, alone: finish 7.9.
    t2 = r[("t2", 0)]
    assert t2.queue_s == pytest.approx(4.9)
    assert t2.overhead_s == pytest.approx(1.0)
    assert t2.exec_s == pytest.approx(2.0)
    assert t2.finish_s == pytest.approx(7.9)


@pytest.mark.parametrize(("runner", "startup_s"), [("xdist", 1.5625), ("tangram", 0.06)])
def test_pod_test_run_capped_at_pod_limit(runner: PytestRunner, startup_s: float) -> None:
    cluster = Cluster(cpu_nodes=1, cores_per_node=8, costs=dataclasses.replace(POD_COSTS, test_runner=runner))
    efficiency = ((1, 1.0), (4, 0.5), (8, 0.5))
    # An idle 8-core node, but the pod's limit is 4 CPUs: pytest -n 4 first starts its workers, 0.33 + 4 * 0.185 *
    # 8 = 6.25 CPU seconds on 4 cores (1.5625 s; on the runner 0.03 * 8 = 0.24, 0.06 s); then speed-up E(4)*4 = 2,
    # so 8 s of work take 4 s; all after the 1 s pod start.
    trace = hand_trace(one_call("a", Call("test", 0.0, 8.0, efficiency=efficiency)))
    rec = run(trace, cluster, "baseline").records[0]
    assert rec.units == 4
    assert rec.queue_s == 0.0
    assert rec.overhead_s == pytest.approx(1.0)
    assert rec.exec_s == pytest.approx(startup_s + 4.0)
    assert rec.finish_s == pytest.approx(1.0 + startup_s + 4.0)


def test_pod_later_calls_run_at_once() -> None:
    # A trajectory's pod lives for its whole life: its second call neither binds nor starts a pod.
    cluster = Cluster(cpu_nodes=1, cores_per_node=4, costs=POD_COSTS)
    trace = hand_trace(Trajectory("a", "task", 0.0, (Call("tool", 0.0, 1.0), Call("tool", 0.5, 1.0))))
    r = by_key(run(trace, cluster, "baseline"))
    # call 0: pod runs at 1.0, finish 2.0; call 1 submitted at 2.5, runs at once: finish 3.5
    assert r[("a", 0)].finish_s == pytest.approx(2.0)
    second = r[("a", 1)]
    assert (second.submit_s, second.start_s, second.overhead_s) == (2.5, 2.5, 0.0)
    assert second.finish_s == pytest.approx(3.5)


# ---------------------------------------------------------------------------------------------------------------
# 3. hand-computed cases: the broker on CPU, fixed DoP against elastic
# ---------------------------------------------------------------------------------------------------------------

CPU_COSTS = Costs(dispatch_s=0.01, env_create_s=0.5, xdist_start_cpu_s=0.0, xdist_worker_share=0.0,
                  runner_share=0.0)  # no start-up
# (the cases below count it only where they say so)
FLAT = ((1, 1.0), (32, 1.0))  # E(m) = 1 everywhere: perfectly scalable
SUBLINEAR = ((1, 1.0), (4, 0.8), (16, 0.5), (32, 0.25))  # E(m)*m grows up to m = 18, so at most 16 is best


def tool_then_test(efficiency: tuple[tuple[int, float], ...], estimate_s: float | None = 32.0) -> Trace:
    return hand_trace(Trajectory("a", "task", 0.0, (Call("tool", 0.0, 1.0),
                                                    Call("test", 0.5, 32.0, efficiency=efficiency,
                                                         estimate_s=estimate_s))))


@pytest.mark.parametrize(("policy", "efficiency", "units", "exec_s"), [
    # elastic: Demand.range(1, 32) on a 16-core node: the most cores; 32 / (E(16)*16)
    ("tangram", FLAT, 16, 2.0),
    ("tangram", SUBLINEAR, 16, 4.0),  # E(16)*16 = 8
    ("tangram-min4", SUBLINEAR, 16, 4.0),
    # fixed DoP: 32 / (E(4)*4)
    ("dop4", FLAT, 4, 8.0),
    ("dop4", SUBLINEAR, 4, 10.0),  # E(4)*4 = 3.2
    ("dop16", SUBLINEAR, 16, 4.0),
])
def test_test_run_dop(policy: str, efficiency: tuple[tuple[int, float], ...], units: int, exec_s: float) -> None:
    cluster = Cluster(cpu_nodes=1, cores_per_node=16, costs=CPU_COSTS)
    assert min(ELASTIC_TEST.max, cluster.cores_per_node) == 16
    r = by_key(run(tool_then_test(efficiency), cluster, policy))
    tool, test = r[("a", 0)], r[("a", 1)]
    # the tool call is the trajectory's first exec: it pays the sandbox creation and the dispatch
    assert (tool.submit_s, tool.start_s, tool.units, tool.exec_s) == (0.0, 0.0, 1, 1.0)
    assert tool.overhead_s == pytest.approx(0.5 + 0.01)
    assert tool.finish_s == pytest.approx(1.51)
    # the test run: submitted after 0.5 s of thinking, on an idle node; dispatch only
    assert test.submit_s == pytest.approx(2.01)
    assert test.start_s == test.submit_s
    assert test.units == units
    assert test.exec_s == pytest.approx(exec_s)
    assert test.overhead_s == pytest.approx(0.01)
    assert test.finish_s == pytest.approx(2.01 + exec_s + 0.01)
    assert tool.pool == test.pool == "cpu0"


def test_malleable_test_run_lends_a_core_to_a_tool_call_and_takes_it_back() -> None:
    cluster = Cluster(cpu_nodes=1, cores_per_node=4, costs=CPU_COSTS)
    trace = hand_trace(one_call("a", Call("test", 0.0, 16.0, efficiency=FLAT, estimate_s=16.0)),
                       one_call("b", Call("tool", 1.0, 1.0)))
    r = by_key(run(trace, cluster, "tangram"))
    test, tool = r[("a", 0)], r[("b", 0)]
    # b's tool call arrives at 1.0 on a node the test run holds whole: it starts at once on a core taken from the
    # test run, and ends at 1.0 + 0.51 + 1.0 = 2.51, when the test run gets its core back.
    assert tool.start_s == 1.0 and tool.finish_s == pytest.approx(2.51)
    assert [units for _, units in test.history] == [4, 3, 4] and test.resizes == 2
    assert [at for at, _ in test.history] == pytest.approx([0.0, 1.0, 2.51])
    # the test run: 0.51 s of sandbox and dispatch, 0.49 s on 4 cores (1.96 s of work), 1.51 s on 3 (4.53 s),
    # then the 9.51 s left on 4 cores: 2.3775 s, finishing at 4.8875
    assert test.finish_s == pytest.approx(4.8875)
    assert test.exec_s == pytest.approx(4.8875 - 0.51)
    assert test.unit_s == pytest.approx(4 * 1.0 + 3 * 1.51 + 4 * 2.3775)


def test_fixed_dop_waits_for_its_cores() -> None:
    # dop16 on a 16-core node: two test runs at once cannot share it; the second waits for the first.
    cluster = Cluster(cpu_nodes=1, cores_per_node=16, costs=CPU_COSTS)
    trace = hand_trace(*(one_call(f"t{i}", Call("test", 0.0, 32.0, efficiency=FLAT, estimate_s=32.0))
                         for i in range(2)))
    r = by_key(run(trace, cluster, policies.broker(DEFAULT_PROFILE, test_demand=Demand.fixed(16))))
    first, second = r[("t0", 0)], r[("t1", 0)]
    # t0: start 0, exec 32/16 = 2, overhead 0.5 + 0.01: finish 2.51; t1 starts then, finish 5.02
    assert first.finish_s == pytest.approx(2.51)
    assert second.start_s == pytest.approx(2.51)
    assert second.finish_s == pytest.approx(5.02)
    assert second.overhead_s == pytest.approx(0.51)  # its own trajectory's first exec


def test_sandbox_created_once_per_trajectory() -> None:
    cluster = Cluster(cpu_nodes=1, cores_per_node=4, costs=CPU_COSTS)
    calls = tuple(Call("tool", 0.0, 1.0) for _ in range(3))
    trace = hand_trace(Trajectory("a", "task", 0.0, calls), Trajectory("b", "task", 0.0, calls))
    r = by_key(run(trace, cluster, "tangram"))
    for tid in ("a", "b"):
        # 0.51 on the first call, 0.01 afterwards; finishes at 1.51, 2.52, 3.53
        assert [r[(tid, i)].overhead_s for i in range(3)] == pytest.approx([0.51, 0.01, 0.01])
        assert [r[(tid, i)].finish_s for i in range(3)] == pytest.approx([1.51, 2.52, 3.53])


# ---------------------------------------------------------------------------------------------------------------
# 3. hand-computed cases: the static GPU deployment
# ---------------------------------------------------------------------------------------------------------------


def test_static_gpu_serves_one_call_at_a_time_without_batching() -> None:
    cluster = Cluster(services=(ServiceModel("rm", static_replicas=1, static_dop=4),), static=StaticServing(batch=1))
    trace = hand_trace(*(one_call(f"t{i}", Call("reward", 1.0, 6.0, "rm", GPU_EFFICIENCY, 6.0)) for i in range(2)))
    result = run(trace, cluster, "baseline")
    r = by_key(result)
    # DoP 4: E(4)*4 = 0.75*4 = 3, so 6 s of work take 2 s. Both arrive at 1.0; one replica:
    # t0 runs 1.0-3.0, t1 waits 2 s and runs 3.0-5.0. Never a restore: no overhead.
    first, second = r[("t0", 0)], r[("t1", 0)]
    assert (first.submit_s, first.start_s, first.finish_s, first.exec_s) == (1.0, 1.0, 3.0, 2.0)
    assert (second.submit_s, second.start_s, second.finish_s, second.exec_s) == (1.0, 3.0, 5.0, 2.0)
    assert second.queue_s == 2.0
    assert first.units == second.units == 4 and first.overhead_s == second.overhead_s == 0.0
    assert first.pool == second.pool == "rm/0"
    assert result.stats["static_gpus"] == 4


def test_static_gpu_batches_calls_and_re_times_them_as_the_batch_changes() -> None:
    cluster = Cluster(services=(ServiceModel("rm", static_replicas=1, static_dop=4),),
                      static=StaticServing(batch=2, prefill_slowdown=0.5))
    calls = (Call("reward", 0.0, 6.0, "rm", GPU_EFFICIENCY), Call("reward", 1.0, 6.0, "rm", GPU_EFFICIENCY),
             Call("reward", 1.0, 3.0, "rm", GPU_EFFICIENCY))
    r = by_key(run(hand_trace(*(one_call(f"t{i}", call) for i, call in enumerate(calls))), cluster, "baseline"))
    # Solo: 2 s, 2 s and 1 s of work at DoP 4. t0 runs alone 0-1 (1 s of work left); t1 joins at 1, t2 waits (batch
    # of 2). Two in the batch: each at 1 / 1.5, so t0 ends at 1 + 1.5 = 2.5 with t1 1 s done; t2 joins at 2.5;
    # t1 and t2 each have 1 s left at 1 / 1.5: both end at 4.0.
    assert [r[(f"t{i}", 0)].finish_s for i in range(3)] == pytest.approx([2.5, 4.0, 4.0])
    assert [r[(f"t{i}", 0)].start_s for i in range(3)] == pytest.approx([0.0, 1.0, 2.5])
    assert r[("t2", 0)].queue_s == pytest.approx(1.5) and r[("t1", 0)].exec_s == pytest.approx(3.0)


def test_static_gpu_replicas_run_in_parallel() -> None:
    cluster = Cluster(services=(ServiceModel("rm", static_replicas=2, static_dop=2),), static=StaticServing(batch=1))
    trace = hand_trace(*(one_call(f"t{i}", Call("reward", 0.0, 1.8, "rm", GPU_EFFICIENCY)) for i in range(3)))
    r = by_key(run(trace, cluster, "baseline"))
    # DoP 2: E(2)*2 = 1.8, so 1 s each; two replicas take t0 and t1 at 0, t2 at 1.0
    assert [r[(f"t{i}", 0)].finish_s for i in range(3)] == pytest.approx([1.0, 1.0, 2.0])
    assert {r[("t0", 0)].pool, r[("t1", 0)].pool} == {"rm/0", "rm/1"}


# ---------------------------------------------------------------------------------------------------------------
# 3. hand-computed cases: API calls without traffic control
# ---------------------------------------------------------------------------------------------------------------


def test_direct_api_quota_errors_exhaust_retries() -> None:
    costs = Costs(api_error_s=0.5, api_backoff_s=1.0, api_retries=3)
    cluster = Cluster(apis=(ApiModel("api.search", quota=1, period_s=10.0, concurrency=5),), costs=costs)
    trace = hand_trace(*(one_call(f"t{i}", Call("api", 0.0, 2.0, "api.search")) for i in range(2)))
    result = run(trace, cluster, "baseline")
    r = by_key(result)
    first, second = r[("t0", 0)], r[("t1", 0)]
    # t0 takes the one unit of quota at 0 and is answered after its latency, 2 s
    assert (first.start_s, first.finish_s, first.exec_s, first.attempts, first.failed) == (0.0, 2.0, 2.0, 1, False)
    # t1: 429 at 0 (answer at 0.5), back-off 1 s: attempts at 0, 1.5, 3.0, 4.5 all within the window of the
    # grant at 0 (until 10); the 4th error at 5.0 uses up the 3 retries
    assert second.attempts == 4 and second.failed
    assert second.finish_s == pytest.approx(5.0)
    assert second.start_s == pytest.approx(4.5)  # the last attempt
    assert second.exec_s == pytest.approx(0.5)
    assert result.stats["api_errors"] == 4 and result.stats["api_timeouts"] == 0


@pytest.mark.parametrize(("retries", "attempts", "start_s", "finish_s", "failed"), [
    (0, 1, 0.0, 30.0, True),  # dropped; the client gives up at its timeout
    (1, 2, 31.0, 36.0, False),  # timeout at 30, back-off 1 s, retry at 31 finds the upstream free: 31 + 5
])
def test_direct_api_concurrency_overflow_times_out(retries: int, attempts: int, start_s: float, finish_s: float,
                                                   failed: bool) -> None:
    costs = Costs(api_timeout_s=30.0, api_backoff_s=1.0, api_retries=retries)
    cluster = Cluster(apis=(ApiModel("api.search", quota=100, period_s=10.0, concurrency=1),), costs=costs)
    trace = hand_trace(*(one_call(f"t{i}", Call("api", 0.0, 5.0, "api.search")) for i in range(2)))
    result = run(trace, cluster, "baseline")
    r = by_key(result)
    assert (r[("t0", 0)].finish_s, r[("t0", 0)].failed) == (5.0, False)
    second = r[("t1", 0)]
    assert (second.attempts, second.failed) == (attempts, failed)
    assert second.start_s == pytest.approx(start_s)
    assert second.finish_s == pytest.approx(finish_s)
    assert result.stats["api_timeouts"] == 1 and result.stats["api_errors"] == 0


# ---------------------------------------------------------------------------------------------------------------
# 3. hand-computed cases: the broker on GPUs and APIs
# ---------------------------------------------------------------------------------------------------------------

GPU_COSTS = Costs(h2d_gb_per_s=5.0, evict_s=0.25)


@pytest.mark.parametrize("dops", [(1,), (1, 2, 4, 8)])
def test_tangram_restores_once(dops: tuple[int, ...]) -> None:
    service = ServiceModel("rm", dops=dops, gpu_memory_mb=40_000, host_memory_mb=10_240)
    cluster = Cluster(gpu_node_sizes=(1,), gpu_memory_mb=81_920, services=(service,), costs=GPU_COSTS)
    trace = hand_trace(Trajectory("a", "task", 0.0, (Call("reward", 0.0, 3.0, "rm", GPU_EFFICIENCY, 3.0),
                                                     Call("reward", 1.0, 3.0, "rm", GPU_EFFICIENCY, 3.0))))
    result = run(trace, cluster, "tangram")
    r = by_key(result)
    first, second = r[("a", 0)], r[("a", 1)]
    # restore: 10240 MiB / 1024 / 1 GPU / 5 GB/s = 2 s; exec 3 s on the node's one GPU: finish 5
    assert (first.start_s, first.units, first.pool) == (0.0, 1, "gpu0:0+1")
    assert first.overhead_s == pytest.approx(2.0)
    assert first.exec_s == pytest.approx(3.0)
    assert first.finish_s == pytest.approx(5.0)
    # 1 s of thinking, then the service is still resident: no overhead, finish 6 + 3 = 9
    assert (second.submit_s, second.start_s, second.overhead_s) == (6.0, 6.0, 0.0)
    assert second.finish_s == pytest.approx(9.0)
    assert (result.stats["restores"], result.stats["evictions"]) == (1, 0)


@pytest.mark.parametrize(("gpu_memory_mb", "overheads", "restores", "evictions"), [
    # each over half of the GPU's 81,920 MiB: every switch evicts the other (evict 0.25 s + restore)
    # A: 10240/1024/5 = 2 s, B: 5120/1024/5 = 1 s
    (50_000, [2.0, 1.0 + 0.25, 2.0 + 0.25], 3, 2),
    # both fit at once: A, then B, then A still resident
    (40_000, [2.0, 1.0, 0.0], 2, 0),
])
def test_tangram_services_evict_each_other(gpu_memory_mb: int, overheads: list[float], restores: int,
                                           evictions: int) -> None:
    services = (ServiceModel("A", dops=(1,), gpu_memory_mb=gpu_memory_mb, host_memory_mb=10_240),
                ServiceModel("B", dops=(1,), gpu_memory_mb=gpu_memory_mb, host_memory_mb=5_120))
    cluster = Cluster(gpu_node_sizes=(1,), gpu_memory_mb=81_920, services=services, costs=GPU_COSTS)
    calls = tuple(Call("reward", 0.0, 1.0, target) for target in ("A", "B", "A"))
    result = run(hand_trace(Trajectory("a", "task", 0.0, calls)), cluster, "tangram")
    r = by_key(result)
    assert [r[("a", i)].overhead_s for i in range(3)] == pytest.approx(overheads)
    # back to back, 1 s of execution each
    finishes = [sum(overheads[: i + 1]) + i + 1 for i in range(3)]
    assert [r[("a", i)].finish_s for i in range(3)] == pytest.approx(finishes)
    assert (result.stats["restores"], result.stats["evictions"]) == (restores, evictions)


def test_tangram_api_quota_on_the_virtual_clock() -> None:
    cluster = Cluster(apis=(ApiModel("api.search", quota=2, period_s=10.0, concurrency=10),))
    trace = hand_trace(*(one_call(f"t{i}", Call("api", 0.0, 1.0, "api.search")) for i in range(3)))
    r = by_key(run(trace, cluster, "tangram"))
    # two units of quota at 0: t0 and t1 run 0-1; t2 waits until the grants at 0 leave the window at 10
    for tid, start in (("t0", 0.0), ("t1", 0.0), ("t2", 10.0)):
        rec = r[(tid, 0)]
        assert (rec.submit_s, rec.start_s, rec.finish_s, rec.exec_s) == (0.0, start, start + 1.0, 1.0)
        assert (rec.attempts, rec.failed, rec.pool) == (1, False, "api.search")
    assert r[("t2", 0)].queue_s == 10.0


def test_tangram_api_concurrency_queues_instead_of_timing_out() -> None:
    cluster = Cluster(apis=(ApiModel("api.search", quota=100, period_s=10.0, concurrency=1),),
                      costs=Costs(api_timeout_s=30.0))
    trace = hand_trace(*(one_call(f"t{i}", Call("api", 0.0, 5.0, "api.search")) for i in range(3)))
    r = by_key(run(trace, cluster, "tangram"))
    # one at a time: 0-5, 5-10, 10-15; nothing is dropped
    assert [(r[(f"t{i}", 0)].start_s, r[(f"t{i}", 0)].finish_s) for i in range(3)] == [(0.0, 5.0), (5.0, 10.0),
                                                                                      (10.0, 15.0)]
    assert not any(rec.failed for rec in r.values())


@pytest.mark.parametrize("test_runner", ["xdist", "tangram"])
def test_a_first_run_of_unknown_duration_then_a_learned_one(test_runner: PytestRunner) -> None:
    # No declared T1. Under xdist the first test run is scheduled at its minimum, 1 core (Alg. 1 line 6): 32 s +
    # 0.51 s. On the runner it starts there too, malleable with its gains deferred to any estimated action's, and
    # with nobody else on the node it takes all 16 cores: 2 s + 0.51 s. Either way the broker then knows T1
    # (learned from the run), so the second one is elastic and takes all 16 cores.
    costs = dataclasses.replace(CPU_COSTS, test_runner=test_runner)
    cluster = Cluster(cpu_nodes=1, cores_per_node=16, costs=costs)
    calls = (Call("test", 0.0, 32.0, efficiency=FLAT), Call("test", 0.0, 32.0, efficiency=FLAT))
    r = by_key(run(hand_trace(Trajectory("a", "task", 0.0, calls)), cluster, "tangram"))
    first, second = r[("a", 0)], r[("a", 1)]
    first_s = 32.0 if test_runner == "xdist" else 2.0
    assert first.units == (1 if test_runner == "xdist" else 16) and first.exec_s == pytest.approx(first_s)
    assert first.finish_s == pytest.approx(first_s + 0.51)
    assert second.units == 16 and second.exec_s == pytest.approx(2.0)
    assert second.finish_s == pytest.approx(first_s + 0.51 + 2.0 + 0.01)


# ---------------------------------------------------------------------------------------------------------------
# liveness: the broker never leaves a call waiting on idle resources for ever
# ---------------------------------------------------------------------------------------------------------------


def test_tangram_starts_a_lone_reward_on_idle_gpus() -> None:
    # Nodes of 1 and 2 GPUs, one service at DoPs 1/2/4/8. t1 (2 s) and t2 (1 s) arrive at 0 and run at once,
    # t1 on gpu1:0+2, t2 on gpu0:0+1 (both restore the service; done by 1.64). At 2.0 t0 arrives to three idle
    # GPUs and must start then; being alone on an idle cluster, nothing can be gained by holding it back.
    cluster = Cluster(gpu_node_sizes=(1, 2), services=(ServiceModel("rm"),))
    trace = hand_trace(*(one_call(f"t{i}", Call("reward", think, work, "rm", GPU_EFFICIENCY, work))
                         for i, (think, work) in enumerate(((2.0, 1.0), (0.0, 2.0), (0.0, 1.0)))))
    r = by_key(run(trace, cluster, "tangram"))
    assert r[("t0", 0)].start_s == 2.0


def test_tangram_work_conserving_on_one_gpu() -> None:
    # One 1-GPU node; three rewards arrive together on an idle node. Whatever the order, one of them must start
    # at 0 (the approximated objective of starting it or holding it back differs only by float rounding).
    cluster = Cluster(gpu_node_sizes=(1,), services=(ServiceModel("rm"),))
    trace = hand_trace(*(one_call(f"t{i}", Call("reward", 0.0, work, "rm", GPU_EFFICIENCY, work))
                         for i, work in enumerate((3.1, 2.6, 1.9))))
    result = run(trace, cluster, "tangram")
    assert len(result.records) == 3
    assert min(rec.start_s for rec in result.records) == 0.0


def test_trajectories_holding_memory_go_on_while_a_new_one_waits_for_memory() -> None:
    # One node, 4 cores, memory for two 4 GiB sandboxes; three trajectories of two 1 s tool calls each. The third
    # cannot get a sandbox until one of the first two ends; their second calls must not wait behind it (that was a
    # deadlock: memory comes back only when a trajectory ends).
    cluster = Cluster(cpu_nodes=1, cores_per_node=4, node_memory_mb=8192)
    calls = (Call("tool", 0.0, 1.0), Call("tool", 0.5, 1.0))
    trace = hand_trace(*(Trajectory(f"t{i}", "task", 0.0, calls, memory_mb=4096) for i in range(3)))
    records = by_key(run(trace, cluster, "tangram"))
    assert len(records) == 6
    first_end = min(records[(f"t{i}", 1)].finish_s for i in (0, 1))
    assert records[("t0", 1)].start_s == pytest.approx(records[("t0", 0)].finish_s + 0.5)
    assert records[("t2", 0)].start_s == pytest.approx(first_end)


def test_each_xdist_worker_costs_a_share_of_the_suite_and_the_runner_one_share_for_all() -> None:
    """``costs.xdist_worker_share``: each xdist worker imports and collects the whole suite, so its start-up grows
    with it and with the workers; the runner (the default) collects once and costs ``runner_share`` of the work
    however many workers it forks, and nothing as plain pytest, unless its workers follow a malleable run's cores."""
    old = Costs(test_runner="xdist", xdist_start_cpu_s=0.05, xdist_worker_cpu_s=0.22, xdist_worker_share=0.0)
    calibrated = Costs(test_runner="xdist")
    assert startup_cpu_s(old, 4, 100.0) == startup_cpu_s(old, 4, 1.0) == pytest.approx(0.05 + 4 * 0.22)
    assert startup_cpu_s(calibrated, 4, 100.0) == pytest.approx(0.33 + 4 * 18.5)
    assert startup_cpu_s(calibrated, 1, 100.0) == startup_cpu_s(calibrated, 1, 100.0, follows=True) == 0.0
    runner = Costs()
    assert startup_cpu_s(runner, 4, 100.0) == startup_cpu_s(runner, 16, 100.0) == pytest.approx(3.0)
    assert startup_cpu_s(runner, 1, 100.0) == 0.0 and startup_cpu_s(runner, 1, 100.0, follows=True) == 3.0
    with pytest.raises(ValueError, match="test_runner"):
        Costs(test_runner="nose")  # type: ignore[arg-type]  # as --set would pass it, unchecked


def test_the_suite_curve_fit_recovers_the_simulators_parameters() -> None:
    """``bench_suite_curves`` fits the simulator's own execution model to measured times: on times the simulator
    itself produced, it gives back the parameters that produced them."""
    from loadtest.bench_suite_curves import configs, fit_simulator, simulated_s

    truth = (30.0, 0.06, 0.4, 3.0)  # work, serial fraction, xdist start CPU s, CPU s per worker
    fitted = fit_simulator({config: simulated_s(truth, config) for config in configs(4)})
    assert [fitted[k] for k in ("work_s", "serial", "xdist_start_cpu_s", "xdist_worker_cpu_s")] == pytest.approx(
        truth, rel=1e-3, abs=1e-3)
    assert fitted["worst_error"] < 1e-6


def test_serverless_loads_at_the_static_dop_where_the_broker_takes_every_idle_gpu() -> None:
    """The ServerlessLLM-style baseline restores a model on demand like the broker, but only at its static DoP."""
    service = ServiceModel("rm", dops=(1, 2, 4, 8), host_memory_mb=10_240, static_dop=4)
    cluster = Cluster(gpu_node_sizes=(8,), services=(service,), costs=GPU_COSTS)
    trace = hand_trace(one_call("a", Call("reward", 0.0, 3.0, "rm", GPU_EFFICIENCY, 3.0)))
    serverless = by_key(run(trace, cluster, "serverless"))[("a", 0)]
    broker = by_key(run(trace, cluster, "tangram"))[("a", 0)]
    # serverless: 4 GPUs; restore 10240 MiB / 1024 / 4 GPUs / 5 GB/s = 0.5 s; exec 3 / (0.75 x 4) = 1 s
    assert (serverless.units, serverless.overhead_s, serverless.exec_s) == (4, pytest.approx(0.5), pytest.approx(1.0))
    # the broker gives a lone call the node's 8: restore 0.25 s, exec 3 / (0.55 x 8)
    assert (broker.units, broker.overhead_s, broker.exec_s) == (8, pytest.approx(0.25), pytest.approx(3 / 4.4))


def test_the_broker_policies_build_their_cycle_from_the_scheduler_profile() -> None:
    """A station runs the profile it is given, as the broker does; a variant changes only what its name says, and an
    order for a resource the cluster lacks is unused."""
    gpus = Cluster(gpu_node_sizes=(1,), services=(ServiceModel("rm"),))
    cores = Cluster(cpu_nodes=1, cores_per_node=4)
    profile = dataclasses.replace(DEFAULT_PROFILE, queue_order_by_resource={"gpu": "hrrs"},
                                  hrrs=HrrsArgs(max_wait_s=30.0), elastic=ElasticArgs(horizon=16))

    def cycle_of(cluster: Cluster, policy: Policy) -> Cycle:
        station = policy(cluster)["reward" if cluster.gpu_node_sizes else "test"]
        assert isinstance(station, BrokerStation)
        return station.cycle

    ordered = cycle_of(gpus, policies.broker(profile))
    assert ordered.setup_order is not None and ordered.setup_order.resources == {"gpu"}
    assert ordered.setup_order.max_wait_s == 30.0 and ordered.scheduler.horizon == 16
    assert cycle_of(gpus, policies.POLICIES["tangram"]).setup_order is None  # the default profile: FCFS
    assert cycle_of(cores, policies.broker(profile)).setup_order is None
    paper = cycle_of(gpus, policies.named_policies(profile)["tangram-paper"])
    assert paper.arrivals is None and paper.setup_order is not None and paper.scheduler.horizon == 16
    srpt = cycle_of(gpus, policies.named_policies(DEFAULT_PROFILE)["tangram-srpt"]).scheduler
    assert srpt.share_by_remaining and srpt.depth == DEFAULT_PROFILE.elastic.depth
