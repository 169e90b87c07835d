"""The batched durations (``tangram.sched.durations_at``) against the model's own per-count call, bit for bit: the
scheduler's plans must not change with the way its durations are evaluated."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.sched.durations import DurationModel
from tangram.sched.durations_at import durations_at
from tangram.sched.speedup import PRIOR, Run, Speedup, SpeedupFit, declared, size_of

# listed counts and the asked ones drawn from one small range, so that many land on a listed count, below the first,
# above the last or between two
elasticities = st.builds(
    lambda counts, efficiencies, t1: Elasticity("cpu", tuple(zip(counts, efficiencies)), t1),
    st.lists(st.integers(1, 40), max_size=7, unique=True).map(sorted),
    st.lists(st.floats(1e-3, 4.0), min_size=7, max_size=7),
    st.none() | st.floats(1e-3, 1e5))
# learned trust ends are twice a run's mean units (any float), or a listed count, or none (the prior)
trusts = st.just(math.inf) | st.floats(0.5, 80.0) | st.integers(1, 40).map(float)
fits = st.builds(SpeedupFit, st.floats(0.0, 50.0), st.floats(1e-4, 50.0), st.floats(0.0, 50.0), st.floats(0.0, 50.0),
                 trusts) | st.just(PRIOR)
counts = st.lists(st.integers(1, 48), max_size=20, unique=True).map(lambda c: tuple(sorted(c)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(fits, elasticities, counts), max_size=12))
def test_batched_durations_equal_the_per_count_call(actions: list[tuple[SpeedupFit, Elasticity, tuple[int, ...]]]):
    expected = [tuple(fit.duration(elasticity, m) for m in asked) for fit, elasticity, asked in actions]
    got = durations_at([a[0] for a in actions], [a[1] for a in actions], [a[2] for a in actions])
    assert got == expected


runs = st.lists(st.tuples(st.floats(1.0, 32.0), st.integers(1, 64), st.floats(1e-2, 1e3)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(runs, elasticities, counts), min_size=1, max_size=4))
def test_batched_durations_of_learned_fits(actions: list[tuple[list[tuple[float, int, float]], Elasticity,
                                                               tuple[int, ...]]]):
    """Fits learned from runs, each widened to its declaration's span as the model asks for them."""
    fitted = []
    for observed, elasticity, _ in actions:
        size = size_of(elasticity)
        model = Speedup(Run(units, workers, declared(elasticity, units), seconds, size)
                        for units, workers, seconds in observed)
        fitted.append(model.fit(elasticity))
    expected = [tuple(fit.duration(e, m) for m in asked) for fit, (_, e, asked) in zip(fitted, actions)]
    assert durations_at(fitted, [a[1] for a in actions], [a[2] for a in actions]) == expected


def test_model_batches_only_what_it_has_not_asked_and_answers_unknown_actions_with_the_default():
    model = DurationModel(default_s=3.0)
    known = Elasticity("cpu", ((1, 1.0), (8, 0.6)), t1=20.0)
    elastic = [Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.range(1, 8)}, elasticity=known,
                      signature=f"s{i}") for i in range(3)]
    unknown = Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.range(1, 8)}, elasticity=Elasticity("cpu"))
    first = model.durations(elastic[0], (1, 2, 3))  # asked one at a time, then again with the rest
    got = model.durations_many([*elastic, unknown], [(1, 2, 3), (2, 5, 8), (7,), (1, 4)])
    assert got == [first, model.durations(elastic[1], (2, 5, 8)), (model.duration(elastic[2], 7),), (3.0, 3.0)]
    assert got[0] is first


def test_a_declaration_from_another_process_keys_the_cache_as_one_built_here() -> None:
    """``Elasticity`` keeps its hash (a queued action's declaration keys the duration cache at every pass); one
    pickled under another hash seed, as Ray or the simulator's workers carry it, hashes as this process's own."""
    elasticity = Elasticity("cpu", ((1, 1.0), (4, 0.8)), 12.5)
    script = ("import pickle, sys\nfrom tangram.core.action import Elasticity\n"
              "sys.stdout.buffer.write(pickle.dumps(Elasticity('cpu', ((1, 1.0), (4, 0.8)), 12.5)))")
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    pickled = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
    carried = pickle.loads(pickled)
    assert carried == elasticity and hash(carried) == hash(elasticity)
    assert {elasticity: "known"}[carried] == "known"
    assert carried.counts == (1, 4)
