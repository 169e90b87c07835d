"""GPU types in the simulator (issue 18): a reward call runs at its service's speed on the node's type, and a
placement confines each service to the types where it has a variant."""

from __future__ import annotations

import pytest

from managers.gpu.gpu_types import GPU_TYPES, speed
from tangram.sched.profile import DEFAULT_PROFILE
from tangram.sim.assumptions import parse
from tangram.sim.broker_station import gpu_node_configs
from tangram.sim.cluster import Cluster, ServiceModel
from tangram.sim.engine import simulate
from tangram.sim.gpu_scenarios import hetero_cluster
from tangram.sim.placement import solve, trace_loads
from tangram.sim.policies import POLICIES, broker
from tangram.sim.records import CallRecord
from tangram.sim.scenario_common import NONE_ASSUMED
from tangram.sim.trace import Call, Trace, Trajectory

#: one GPU of each type; a teacher that scores (compute-bound) and a judge that generates (memory-bound)
MIXED = Cluster(gpu_node_sizes=(1, 1), gpu_node_types=("h100", "h20"),
                services=(ServiceModel("teacher", dops=(1,)), ServiceModel("judge", dops=(1,), generates=True)))
#: an H20 scores at 15% of an H100's speed
SLOWER = 1 / speed(GPU_TYPES["h20"], GPU_TYPES["h100"], "compute")


def trace() -> Trace:
    """Calls of one second on an H100 arriving together: twice as much judge work as teacher work."""
    calls = [("teacher", i) for i in range(6)] + [("judge", i) for i in range(12)]
    return Trace("hetero", 1, {}, [Trajectory(f"{service}-{i}", "t", 0.0, (Call("reward", 1.0, 1.0, service),))
                                   for service, i in calls])


def teacher_calls(policy_records: list[CallRecord]) -> list[CallRecord]:
    return [r for r in policy_records if r.target == "teacher"]


def test_the_ilp_confines_the_compute_bound_service_to_the_h100_and_it_runs_faster_than_type_blind() -> None:
    loads = trace_loads(trace())
    assert loads["judge"] == pytest.approx(2 * loads["teacher"])
    placement = solve("ilp", MIXED, gpu_node_configs(MIXED), loads)
    assert placement.method == "ilp" and placement.variants("teacher") == ("h100",)
    assert "h20" in placement.variants("judge")
    placed = simulate(trace(), MIXED, broker(DEFAULT_PROFILE, placement="ilp", loads=loads), "placed")
    blind = simulate(trace(), MIXED, POLICIES["tangram"], "blind")
    assert {r.pool.split(":")[0] for r in teacher_calls(placed.records)} == {"gpu0"}
    assert "gpu1" in {r.pool.split(":")[0] for r in teacher_calls(blind.records)}
    mean_exec = [sum(r.exec_s for r in teacher_calls(run.records)) / 6 for run in (placed, blind)]
    assert mean_exec[0] == pytest.approx(1.0) and mean_exec[1] > 1.0
    assert placed.summary()["placement"]["method"] == "ilp"


def test_a_call_on_the_h20_takes_its_h100_time_over_its_speed_there() -> None:
    records = simulate(trace(), MIXED, POLICIES["tangram"], "blind").records
    for record in records:
        on_h20 = record.pool.startswith("gpu1")
        if record.target == "teacher":
            assert record.exec_s == pytest.approx(SLOWER if on_h20 else 1.0)
        else:
            assert record.exec_s == pytest.approx(1 / speed(GPU_TYPES["h20"], GPU_TYPES["h100"], "memory")
                                                  if on_h20 else 1.0)


def test_an_untyped_cluster_is_all_reference_type() -> None:
    untyped = Cluster(gpu_node_sizes=(1, 1), services=MIXED.services)
    assert [node.type for node in gpu_node_configs(untyped)] == ["h100", "h100"]
    assert all(r.exec_s == 1.0 for r in simulate(trace(), untyped, POLICIES["tangram"], "blind").records)
    with pytest.raises(ValueError, match="unknown GPU types"):
        Cluster(gpu_node_sizes=(1,), gpu_node_types=("h999",))
    with pytest.raises(ValueError, match="1 GPU node types for 2"):
        Cluster(gpu_node_sizes=(1, 1), gpu_node_types=("h20",))


def test_the_managers_own_placement_learns_the_loads_as_the_run_goes() -> None:
    """No oracle: the GPU manager measures each service's demand from the actions themselves and solves its own
    placement (``[gpu.placement] method = "ilp"``) inline on the virtual clock; with the typed fit, as in the
    service."""
    live = simulate(trace(), MIXED, broker(DEFAULT_PROFILE, typed_fit=True, live_placement="ilp"),
                    "live").summary()["live_placement"]
    assert live["solves"] == {"ilp": 1}  # the first pass; the run ends before the next is due
    assert live["loads"]["judge"] > live["loads"]["teacher"] > 0
    assert live["last"]["method"] == "ilp" and set(live["last"]["shares"]["teacher"]) == {"h100"}


def test_the_typed_fit_keeps_the_scorer_off_the_h20_while_an_h100_frees_soon_enough() -> None:
    typed = simulate(trace(), MIXED, broker(DEFAULT_PROFILE, typed_fit=True), "typed")
    blind = simulate(trace(), MIXED, POLICIES["tangram"], "blind")
    assert {r.pool.split(":")[0] for r in teacher_calls(typed.records)} == {"gpu0"}
    assert "gpu1" in {r.pool.split(":")[0] for r in teacher_calls(blind.records)}
    assert typed.summary()["mean_act_s"] < blind.summary()["mean_act_s"]


def test_the_h20s_speeds_move_with_the_assumptions() -> None:
    assumed = hetero_cluster(parse(["hetero.tflops_factor=2", "hetero.hbm_factor=1.5"])).gpu_types
    shipped = hetero_cluster(NONE_ASSUMED).gpu_types
    assert shipped["h20"] == GPU_TYPES["h20"]
    assert speed(assumed["h20"], assumed["h100"], "compute") == pytest.approx(2 * 148 / 989)
    assert speed(assumed["h20"], assumed["h100"], "memory") == pytest.approx(1.5 * 4000 / 3350)
    assert assumed["h100"] == shipped["h100"]
