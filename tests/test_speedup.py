"""The learned speed-up model (``tangram.sched.speedup`` through ``DurationModel``): runs of a suite whose real curve
the client never declares, scheduled by the service's own scheduler and dispatch, on a moldable and a malleable
manager; bad observations; the declared bounds; persistence through the store."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from managers.counted import CountedUnitsManager
from managers.cpu.config import CpuConfig, CpuNodeConfig
from managers.cpu.manager import CpuManager
from managers.cpu.node import CpuNode
from tangram.cli import status_view
from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.malleable import Workers
from tangram.core.seam import ResourceManager
from tangram.records import Profiles, Resources
from tangram.sched import dispatch
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler
from tangram.sched.speedup import Run, Speedup, SpeedupFit, declared
from tangram.sim.broker_station import NoSandboxes
from tangram.store.store import Store
from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import live_broker

UNDECLARED = Elasticity("cpu")  # what a user who knows nothing sends


def short_suite(m: int) -> float:
    """A ~1 s suite (the issue's 1.2 s one): going parallel (xdist's controller, each worker's imports on its own
    core) costs more than the parallel part gains: 0.7x on 2 cores."""
    return 0.2 + 1.0 / m + (1.0 if m > 1 else 0.0)


def long_suite(m: int) -> float:
    """A minute and a half on one core, 5 s of it serial; going parallel costs 3 s: every doubling still pays."""
    return 5.0 + 80.0 / m + (3.0 if m > 1 else 0.0)


def moldable(cores: int) -> ResourceManager:
    return CountedUnitsManager({"cpu": {"n0": cores}})


def malleable(cores: int, worker_overhead: float = 0.0) -> ResourceManager:
    config = CpuNodeConfig(name="n", cores=tuple(range(cores)), numa=(tuple(range(cores)),), memory_mb=1 << 20)
    cpu = CpuManager(CpuConfig(nodes=(config,), worker_overhead=worker_overhead))
    cpu.add_node(CpuNode(config, NoSandboxes()))
    return cpu


class Bench:
    """One manager, the service's scheduler and dispatch, and a virtual clock: runs actions one at a time."""

    def __init__(self, manager: ResourceManager) -> None:
        self.manager = manager
        self.durations = DurationModel()
        self.scheduler = Scheduler([manager], self.durations)
        self.owner = {resource: manager for resource in manager.resources}
        self.now = 0.0
        self.seq = 0

    def action(self, demand: Demand, elasticity: Elasticity = UNDECLARED, signature: str = "test|suite") -> Action:
        self.seq += 1
        action = Action(task="t", kind=Kind.EXEC, demands={"cpu": demand}, elasticity=elasticity,
                        signature=signature, trajectory=f"traj-{self.seq}", spec={"command": "pytest"},
                        id=f"a{self.seq}", seq=self.seq)
        return action

    def run(self, action: Action, seconds: Callable[[int], float], succeeded: bool = True,
            result: object = None) -> int:
        """Schedule ``action`` alone, let it take ``seconds(units)`` and end it; returns its units."""
        [placement] = self.scheduler.schedule([action], [], self.now).placements
        allocations = dispatch.start(self.owner, self.durations, placement, self.now)
        units = placement.units["cpu"]
        action.execution_s = seconds(units)
        action.result = result
        self.now += action.execution_s
        dispatch.release(allocations)
        dispatch.ended(self.durations, None, action, self.now, succeeded)
        self.now += 1.0
        return units

    def runs(self, count: int, demand: Demand, seconds: Callable[[int], float], **kwargs: object) -> list[int]:
        return [self.run(self.action(demand, **kwargs), seconds) for _ in range(count)]  # type: ignore[arg-type]


@pytest.mark.parametrize("manager", [moldable, malleable])
def test_a_short_suite_settles_at_one_core_within_three_runs(manager: Callable[[int], ResourceManager]) -> None:
    """First run at the minimum (nothing known), one doubling explored, then one core for good: 2 did not pay."""
    bench = Bench(manager(32))
    assert bench.runs(6, Demand.range(1, 32), short_suite) == [1, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("manager", [moldable, malleable])
def test_a_long_suite_settles_at_the_most_cores_that_still_pay(manager: Callable[[int], ResourceManager]) -> None:
    """One doubling at a time while it pays, up to the action's maximum, and there it stays."""
    bench = Bench(manager(32))
    assert bench.runs(8, Demand.range(1, 32), long_suite) == [1, 2, 4, 8, 16, 32, 32, 32]


def test_the_model_stays_within_the_declared_bounds() -> None:
    """Whatever the runs say, an action gets one of its allowed counts: never below its minimum for a suite that
    would rather have one core, never above its maximum for one that would take sixteen."""
    bench = Bench(moldable(32))
    short_units = bench.runs(5, Demand.range(2, 4), short_suite, signature="short")
    assert short_units == [2, 4, 4, 4, 4]  # once parallel, 4 cores beat 2; never 1, which would beat both
    long_units = bench.runs(6, Demand((2, 4)), long_suite, signature="long")
    assert long_units[0] == 2 and set(long_units[1:]) == {4}
    counts = Demand((1, 3, 6)).up_to(32)
    fit = bench.durations.fit(bench.action(Demand((1, 3, 6)), signature="long"))
    assert fit is not None and min(counts, key=lambda m: fit.duration(UNDECLARED, m)) == 6


def test_an_elastic_action_takes_the_t1_its_signature_learned_before_it_ran_elastically() -> None:
    """A task's exec actions share the default signature: a tool call's duration is the first thing learned, and an
    elastic run of that signature with nothing declared is then planned at it (linear), not at its minimum."""
    bench = Bench(moldable(8))
    bench.run(bench.action(Demand.fixed(1), signature="exec|cpu"), lambda m: 4.0)
    elastic = bench.action(Demand.range(1, 8), signature="exec|cpu")
    assert not bench.durations.speedups and bench.durations.scalable(elastic)
    assert [bench.durations.duration(elastic, m) for m in (1, 2, 8)] == pytest.approx([4.0, 2.0, 0.5])


def test_failed_cancelled_and_killed_runs_are_not_observed() -> None:
    bench = Bench(moldable(32))
    bench.run(bench.action(Demand.range(1, 32)), lambda m: 600.0, succeeded=False)  # timed out, OOM, cancelled
    bench.run(bench.action(Demand.range(1, 32)), lambda m: 0.2, result={"exit_code": None, "signal": 9})
    assert not bench.durations.speedups
    assert bench.durations.fit(bench.action(Demand.range(1, 32))) is None  # still unknown: next run at the minimum


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(1, 32), st.floats(0.05, 1.0), max_size=4), st.none() | st.floats(0.1, 100.0),
       st.tuples(st.floats(0, 2), st.floats(0.001, 2), st.floats(0, 2), st.floats(0, 2)),
       st.sampled_from([float("inf"), 2.0, 5.5, 16.0]), st.none() | st.integers(1, 8), st.integers(1, 40))
def test_the_vectorised_curve_is_the_duration_at_every_count(
        efficiency: dict[int, float], t1: float | None, coefficients: tuple[float, float, float, float],
        trusted: float, workers: int | None, top: int) -> None:
    """``SpeedupFit.curve`` (what the malleable sharing reads, in one numpy step) equals ``duration`` count by count:
    interpolated, clamped and undeclared efficiencies, capped trust, fixed or per-unit workers."""
    elasticity = Elasticity("cpu", tuple(sorted(efficiency.items())), t1=t1)
    fit = SpeedupFit(*coefficients, trusted)
    expected = [fit.duration(elasticity, k, workers) for k in range(1, top + 1)]
    assert fit.curve(elasticity, top, workers).tolist() == pytest.approx(expected, rel=1e-12)


@given(st.floats(0.0, 0.9))
def test_an_amdahl_curve_listed_at_powers_of_two_gains_at_every_count_between(serial: float) -> None:
    """A profile as the paper's clients declare it (E at 1, 2, 4, ... 32) reads as a speed-up that never falls
    between the listed counts. Interpolating E itself made a half-serial suite faster on 6 cores than on 8, in the
    simulator's truth and in the broker's model alike; the sharing then stopped every run at the first peak."""
    elasticity = Elasticity("cpu", tuple((m, 1.0 / (serial * m + 1.0 - serial)) for m in (1, 2, 4, 8, 16, 32)))
    speedups = [elasticity.efficiency_at(k) * k for k in range(1, 33)]
    assert all(later >= earlier - 1e-12 for earlier, later in pairwise(speedups))
    for m in (1, 2, 4, 8, 16, 32):  # the listed points are kept exactly
        assert speedups[m - 1] == pytest.approx(1.0 / (serial + (1.0 - serial) / m), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 32), st.integers(1, 4), st.floats(0.01, 1000.0), st.floats(0.1, 100.0)),
                min_size=1, max_size=32))
def test_every_fit_predicts_positive_finite_durations(rows: list[tuple[int, int, float, float]]) -> None:
    """Whatever the runs (sizes declared or not, workers per core, any times), the model's durations are positive and
    finite at every count and worker number, so a speed-up curve is always defined (found: a pooled simulator
    signature once fitted zero work on one core and stalled the queue on NaN shares)."""
    runs = [Run(float(m), m * k, declared(Elasticity("cpu", t1=size), m), seconds, size)
            for m, k, seconds, size in rows]
    fit = Speedup(runs).fit(UNDECLARED)
    for m in (1, 2, 3, 8, 32, 64):
        for workers in (None, 1, m, 4 * m):
            assert 0 < fit.duration(UNDECLARED, m, workers) < float("inf")


def test_a_run_that_waited_on_a_lock_does_not_corrupt_the_model() -> None:
    model = Speedup()
    for m, seconds in [(1, 85.0), (2, 48.0), (4, 30.0), (1, 86.0), (2, 47.0), (4, 31.0)]:
        model.add(Run(m, m, declared(UNDECLARED, m), seconds))
    clean = model.fit(UNDECLARED)
    model.add(Run(2, 2, declared(UNDECLARED, 2), 400.0))  # held a lock for most of its life
    fit = model.fit(UNDECLARED)
    for m in (1, 2, 4, 8):
        assert fit.duration(UNDECLARED, m) == pytest.approx(clean.duration(UNDECLARED, m), rel=0.05)


def test_a_declared_profile_is_a_prior_the_runs_overrule() -> None:
    """Declared: 40 s on one core, linear speed-up. Real: no speed-up at all (10 s whatever the cores). Before any
    run the declaration decides (all 8 cores, 5 s expected); once a few counts have been seen the model expects
    10 s on any count (which count a lone run then takes is a tie the DP breaks either way)."""
    bench = Bench(moldable(8))
    declared_linear = Elasticity("cpu", ((1, 1.0), (8, 1.0)), t1=40.0)
    flat = bench.action(Demand.range(1, 8), declared_linear)
    assert bench.durations.duration(flat, 8) == pytest.approx(5.0)
    assert bench.run(flat, lambda m: 10.0) == 8
    holder = bench.action(Demand.fixed(6), signature="other")  # takes 6 cores: the next run gets the other 2
    [held] = bench.scheduler.schedule([holder], [], bench.now).placements
    allocations = dispatch.start(bench.owner, bench.durations, held, bench.now)
    assert bench.run(bench.action(Demand.range(1, 8), declared_linear), lambda m: 10.0) == 2
    dispatch.release(allocations)
    bench.runs(3, Demand.range(1, 8), lambda m: 10.0, elasticity=declared_linear)
    probe = bench.action(Demand.range(1, 8), declared_linear)
    for m in range(1, 9):
        assert bench.durations.duration(probe, m) == pytest.approx(10.0, rel=0.05)


#: medians measured on this machine (docs/EVALUATION.md, loadtest/bench_suite_curves.py): (cores, workers) -> s
MEASURED = {"pyparsing": {(1, 1): 28.97, (1, 2): 30.44, (2, 2): 13.89, (2, 4): 15.20},
            "networkx": {(1, 1): 56.78, (1, 2): 76.11, (2, 2): 38.28, (2, 4): 50.05}}


def test_learned_worker_costs_decide_who_may_grow_from_one_core() -> None:
    """A run that must start on one core (the other is busy) gets a second worker, to grow into the core when it
    frees, only where workers were seen to be cheap against the run: pyparsing's cost 0.35 s each, networkx's
    ~10 s (each collects the whole suite); at 5% of the expected run, pyparsing gets two workers, networkx one."""
    bench = Bench(malleable(2, worker_overhead=0.05))
    for suite, times in MEASURED.items():
        runs = [Run(float(c), w, declared(UNDECLARED, c), seconds) for (c, w), seconds in times.items()]
        bench.durations.speedups[("t", suite)] = Speedup(runs)
    busy = bench.action(Demand.fixed(1), signature="tool")
    [held] = bench.scheduler.schedule([busy], [], bench.now).placements
    allocations = dispatch.start(bench.owner, bench.durations, held, bench.now)
    for suite, workers in (("pyparsing", 2), ("networkx", 1)):
        action = bench.action(Demand.range(1, 2), signature=suite)
        cost = bench.durations.worker_cost(action, 1)
        assert cost is not None and cost.harness_s > 0
        [placement] = bench.scheduler.schedule([action], [busy], bench.now).placements
        assert (placement.units["cpu"], placement.workers) == (1, Workers(workers)), (suite, cost)
    dispatch.release(allocations)
    only_moldable = bench.action(Demand.range(1, 2), signature="long")
    bench.runs(2, Demand.range(1, 2), long_suite, signature="long")  # one worker per core: 1, then 2
    assert bench.durations.worker_cost(only_moldable, 1) is None  # no run with more workers than cores: unknown


def test_a_malleable_run_is_observed_at_its_mean_units() -> None:
    """A run that held 4 cores for half its time and 2 for the other half is a run on 3 cores, 4 workers."""
    bench = Bench(malleable(8))
    action = bench.action(Demand.range(1, 8), Elasticity("cpu", t1=40.0))
    [placement] = bench.scheduler.schedule([action], [], 0.0).placements
    placement.units["cpu"], placement.workers = 4, Workers(4)
    dispatch.start(bench.owner, bench.durations, placement, 0.0)
    assert action.malleable is not None
    action.malleable.resize(2, 5.0)
    action.execution_s = 10.0
    dispatch.ended(bench.durations, None, action, 10.0, True)
    [run] = bench.durations.speedups[("t", "test|suite")].runs
    assert (run.units, run.workers, run.seconds) == (pytest.approx(3.0), 4, 10.0)


def test_a_run_whose_workers_follow_its_cores_is_modelled_and_observed_with_one_worker_per_core() -> None:
    """Under the runner a run capped at 8 cores starts on 1 with one worker, not 8: its expected duration is the
    model's for one core and one worker. Held on 1 core for half its time and 3 for the other half, it ran on 2
    cores with 2 workers (one forked per core added)."""
    bench = Bench(malleable(8))
    bench.runs(2, Demand.range(1, 8), long_suite, signature="long")  # learned: workers cost time
    action = bench.action(Demand.range(1, 8), signature="long")
    [placement] = bench.scheduler.schedule([action], [], 0.0).placements
    placement.units["cpu"], placement.workers = 1, Workers(8, follows=True)
    dispatch.start(bench.owner, bench.durations, placement, 0.0)
    assert action.malleable is not None and action.malleable.follows and action.malleable.workers == 8
    assert action.expected_duration_s == pytest.approx(bench.durations.duration(action, 1, 1))
    assert bench.durations.duration(action, 1, 8) != pytest.approx(action.expected_duration_s)
    action.malleable.resize(3, 5.0)
    action.execution_s = 10.0
    dispatch.ended(bench.durations, None, action, 10.0, True)
    run = bench.durations.speedups[("t", "long")].runs[-1]
    assert (run.units, run.workers, run.seconds) == (pytest.approx(2.0), 2, 10.0)


async def test_learned_models_survive_a_restart(tmp_path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    bench = Bench(moldable(32))
    bench.runs(3, Demand.range(1, 32), short_suite)
    store = await Store.open(url)
    store.save_profiles(bench.durations.take_dirty())
    store.save_speedups(bench.durations.take_dirty_runs())
    assert bench.durations.take_dirty_runs() == []
    await store.close()
    reopened = await Store.open(url)
    restarted = DurationModel()
    for task, signature, t1, samples in await reopened.load_profiles():
        restarted.load(task, signature, t1, samples)
    for task, signature, runs in await reopened.load_speedups():
        restarted.load_runs(task, signature, runs)
    await reopened.close()
    probe = bench.action(Demand.range(1, 32))
    for m in (1, 2, 4):
        assert restarted.duration(probe, m) == pytest.approx(bench.durations.duration(probe, m))
    assert [r.units for r in restarted.speedups[("t", "test|suite")].runs] == [1, 2, 1]


#: a real pytest suite of ~0.5 s on one core (collection and 60 small tests): xdist's workers cost more than it gains
MINI_SUITE = {"tests/test_mini.py": "import pytest\n\n\n@pytest.mark.parametrize('n', range(60))\n"
                                    "def test_sum(n):\n    assert sum(range(20_000 + n)) > 0\n"}


async def test_a_real_short_suite_settles_at_one_core_within_three_runs(tmp_path) -> None:
    """On a real Docker engine, with no profile declared: the first run on one core, the second on two (explored),
    and from the third on one core, because two really were slower; ``GET /v1/profiles`` shows why. On xdist,
    whose workers each import and collect the suite again (on the runner, two cores cost this suite nothing)."""
    raw = cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1", "memory_mb": 2048}},
                     pytest_runner="xdist")
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        base: dict[str, Any] = {"task": "t", "trajectory": "suite", "kind": "exec", "timeout_s": 120}
        warm = {**base, "demand": {"cpu": 1},
                "spec": {"command": "python3 -m pytest --version && python3 -c 'import xdist'", "memory_mb": 512,
                         "files": MINI_SUITE}}
        _, record = await live.call("POST", "/v1/actions?wait=true", json=warm)  # a warm page cache for all
        assert record["state"] == "succeeded" and record["result"]["exit_code"] == 0, record
        units = []
        for _ in range(5):
            test_run = {**base, "demand": {"cpu": {"min": 1, "max": 2}}, "elasticity": {"resource": "cpu"},
                        "signature": "suite|mini",
                        "spec": {"command": "python3 -m pytest -q -p no:cacheprovider tests", "pytest_parallel": True}}
            _, record = await live.call("POST", "/v1/actions?wait=true", json=test_run)
            assert record["state"] == "succeeded" and record["result"]["exit_code"] == 0, record
            units.append(record["allocation"]["units"]["cpu"])
        assert units == [1, 2, 1, 1, 1]
        code, body = await live.call("GET", "/v1/profiles?task=t")
        assert code == 200
        [learned] = [row for row in body["profiles"] if row["signature"] == "suite|mini"]
        by_units = {(row["units"], row["workers"]): row for row in learned["speedup"]["by_units"]}
        assert set(by_units) == {(1.0, 1), (2.0, 2)} and by_units[(1.0, 1)]["runs"] == 4
        assert by_units[(2.0, 2)]["median_s"] > by_units[(1.0, 1)]["median_s"]
        model = learned["speedup"]
        assert model["per_worker_s"] + model["harness_s"] > 0  # what makes two cores slower: xdist's start-up
        _, resources = await live.call("GET", "/v1/resources")
        Profiles.model_validate_json(json.dumps(body))  # as the document says (generated from the same models)
        Resources.model_validate_json(json.dumps(resources))
        console = Console(record=True, width=200)
        console.print(status_view(live.url, resources, body["profiles"]))
        shown = console.export_text()
        assert "learned speed-up" in shown and "suite|mini" in shown and "(4)" in shown and "(1)" in shown


async def test_a_first_run_on_the_runner_takes_the_idle_core_and_its_next_run_is_estimated(tmp_path) -> None:
    """On a real Docker engine, with no profile declared and the elastic runner (the default): the signature's first
    run starts on its floor and the idle core (nothing known of it, it outbids nobody, but nobody wants the core),
    forks a worker for each and passes as plain pytest does; the record says its profile was assumed. The next run
    is estimated from it."""
    raw = cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1", "memory_mb": 2048}})
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        spec: dict[str, Any] = {"command": "python3 -m pytest -q -p no:cacheprovider tests", "pytest_parallel": True}
        test_run = {"task": "t", "trajectory": "suite", "kind": "exec", "timeout_s": 120,
                    "demand": {"cpu": {"min": 1, "max": 2}}, "elasticity": {"resource": "cpu"},
                    "signature": "suite|mini", "spec": spec}
        records = []
        for files in (MINI_SUITE, None):  # the suite is written with the trajectory's environment
            body = {**test_run, "spec": {**spec, "files": files}} if files else test_run
            code, record = await live.call("POST", "/v1/actions?wait=true", json=body)
            assert code == 200 and record["state"] == "succeeded", record
            assert "60 passed" in record["result"]["stdout"], record
            records.append(record)
        first, second = (record["allocation"]["malleable"] for record in records)
        assert first["assumed"] is True and first["history"][0][1] == 2, first
        assert records[0]["result"]["pytest_runner"]["runner"] == "tangram", records[0]["result"]
        assert second["assumed"] is False, second


def test_runs_at_counts_close_together_fit_the_scale_only() -> None:
    """Runs at 29-32 cores cannot tell serial time from parallel work (P changes by a tenth, less than a run's
    noise). Found in the simulator: such runs were read as a wholly serial suite, and the next runs of the signature
    started on one core with 238 cores free. Until runs a doubling apart exist, only the scale moves."""
    elasticity = Elasticity("cpu", ((1, 1.0), (32, 0.6)), t1=60.0)
    noisy = (1.3, 0.8, 1.25, 0.85, 1.2, 0.9)  # slower at 29 than at 32, then the reverse: noise, not a curve
    runs = [Run(float(m), m, declared(elasticity, m), declared(elasticity, m) * noise, 60.0)
            for m, noise in zip((29, 32, 30, 31, 32, 29), noisy)]
    fit = Speedup(runs).fit(elasticity)
    assert (fit.serial_s, fit.per_worker_s, fit.harness_s) == (0.0, 0.0, 0.0)
    assert fit.duration(elasticity, 32) < fit.duration(elasticity, 8) < fit.duration(elasticity, 1)
    # a doubling apart, the same runs tell: faster than declared at 8 and slower at 29-32 is serial time
    wider = Speedup([*runs, *(Run(8.0, 8, declared(elasticity, 8), declared(elasticity, 8) * x, 60.0)
                              for x in (0.72, 0.78))])
    assert wider.fit(elasticity).serial_s > 0


def test_a_squeezed_run_at_the_same_count_is_read_as_worker_cost_not_a_larger_suite() -> None:
    """pyflakes on one core, measured through the broker (2026-11-26): plain pytest 1.27 s, two workers squeezed
    onto the core 2.19 s. Runs at one count fit the scale only, which read the pair as a 1.5 s suite (the plain run
    predicted 18% slow, the squeezed one 31% fast, so it looked cheap to squeeze again); plain and squeezed runs
    together tell the workers' cost apart, serial time still not."""
    runs = [Run(1.0, 1, declared(UNDECLARED, 1), 1.27), Run(1.0, 2, declared(UNDECLARED, 1), 2.19)]
    fit = Speedup(runs).fit(UNDECLARED)
    assert fit.duration(UNDECLARED, 1) == pytest.approx(1.27, rel=0.02)
    assert fit.duration(UNDECLARED, 1, workers=2) == pytest.approx(2.19, rel=0.02)
    assert fit.serial_s == 0.0 and fit.per_worker_s + fit.harness_s > 0
    # squeezed runs alone (no plain run to set them against) still fit the scale only
    squeezed = Speedup([Run(1.0, 2, declared(UNDECLARED, 1), 2.19)] * 2).fit(UNDECLARED)
    assert (squeezed.serial_s, squeezed.per_worker_s, squeezed.harness_s) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("resize", [False, True])
def test_the_learning_bench_plans_each_pass_twice_on_the_same_state(resize: bool) -> None:
    """``bench_scheduler --learn``: both schedulers plan every pass (the declared one's plan dropped), so each has a
    time per pass, and the figure is the geometric mean of the two orders' median ratios."""
    from loadtest.bench_scheduler import run

    figures = run(256, 41, 1, 64, 1, 2, 16, resize=resize, learn=True)
    assert figures["passes"] == 41 and figures["completed"] > 0
    first, second = figures["learning_first"], figures["learning_second"]
    assert first > 0 and second > 0 and figures["declared_median_ms"] > 0
    assert figures["learning/declared"] == pytest.approx((first * second) ** 0.5)
    assert "learning/declared" not in run(256, 11, 1, 64, 1, 2, 16, resize=resize, learn=False)


@pytest.mark.parametrize("resize", [False, True])
def test_the_scheduling_bench_refuses_fewer_passes_than_its_figures_need(resize: bool) -> None:
    """One pass is only the cold one: the steady-state median would be of nothing, so it is refused up front (it
    raised from ``statistics.median`` after the run), and two passes give each figure."""
    from loadtest.bench_scheduler import run

    with pytest.raises(ValueError, match="passes: at least 2"):
        run(64, 1, 1, 16, 1, 2, 16, resize=resize)
    figures = run(64, 2, 1, 16, 1, 2, 16, resize=resize)
    assert figures["passes"] == 2 and figures["median_ms"] > 0
