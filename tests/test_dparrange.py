"""DPArrange against brute force on small random instances, for every prefix and both fill paths."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.core.dparrange import BasicOperator, dp_arrange, dp_arrange_many


class SubtractingOperator(BasicOperator):
    """The Basic operator forced through the generic state-by-state path."""

    linear = False


def brute_force(options, free: int, t: int) -> float:
    best = math.inf
    for combo in itertools.product(*(list(zip(c, d)) for c, d in options[:t])):
        if sum(k for k, _ in combo) <= free:
            best = min(best, sum(d for _, d in combo))
    return best


task = st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True).flatmap(
    lambda counts: st.tuples(st.just(tuple(sorted(counts))),
                             st.lists(st.floats(0.01, 100.0), min_size=len(counts), max_size=len(counts))))


@pytest.mark.slow  # seconds: left out of the fast lane
@settings(max_examples=300, deadline=None)
@given(options=st.lists(task, min_size=1, max_size=5), free=st.integers(0, 14))
def test_every_prefix_matches_brute_force(options, free):
    for operator in (BasicOperator(), SubtractingOperator()):
        table = dp_arrange(options, free, operator)
        for t in range(len(options) + 1):
            total, units = table.best(t)
            expected = brute_force(options, free, t)
            assert math.isclose(total, expected, rel_tol=1e-9) or total == expected == math.inf
            if total < math.inf:
                assert len(units) == t and sum(units) <= free
                assert all(k in counts for k, (counts, _) in zip(units, options))
                got = sum(dict(zip(c, d))[k] for k, (c, d) in zip(units, options))
                assert math.isclose(got, total, rel_tol=1e-9)


def test_more_units_are_not_forced_when_they_are_slower():
    # E(m) < 1 can make 2 units slower than 1; the printed dp[m][n] would force all 4 units into use.
    options = [((1, 2), (10.0, 12.0)), ((1, 2), (10.0, 12.0))]
    total, units = dp_arrange(options, 4).best(2)
    assert (total, units) == (20.0, [1, 1])


def test_prefix_that_cannot_fit_is_infinite():
    table = dp_arrange([((2,), (1.0,)), ((2,), (1.0,))], 3)
    assert table.best(1) == (1.0, [2])
    assert table.best(2)[0] == math.inf


@settings(max_examples=150, deadline=None)
@given(options=st.lists(task, min_size=1, max_size=7), free=st.integers(0, 16), data=st.data())
def test_a_banded_table_answers_its_prefixes_as_the_full_table(options, free, data):
    """Greedy eviction asks only for long prefixes, so its tables hold the band of states those can use: the same
    optimum and units, ties included, for every prefix the band holds and every limit, filled alone or with others."""
    shortest = data.draw(st.integers(0, len(options)))
    full = dp_arrange(options, free)
    banded = dp_arrange(options, free, shortest=shortest)
    other = options[::-1]
    together = dp_arrange_many([(other, free + 3, None, 0), (options, free, None, shortest)])
    for t in range(shortest, len(options) + 1):
        for limit in (None, *range(free + 2)):
            assert banded.best(t, limit) == full.best(t, limit) == together[1].best(t, limit)
    for t in range(len(other) + 1):
        assert together[0].best(t) == dp_arrange(other, free + 3).best(t)
    if shortest > 1:
        with pytest.raises(ValueError):
            banded.best(shortest - 1)


@settings(max_examples=150, deadline=None)
@given(options=st.lists(task, min_size=1, max_size=7), free=st.integers(0, 16), data=st.data())
def test_a_table_gives_the_durations_of_the_units_it_chose(options, free, data):
    """A plan's completion times are read from its table: each task's duration at the units ``best`` gave it, as
    the task's options list it, for banded linear tables and the generic path alike."""
    shortest = data.draw(st.integers(0, len(options)))
    for table in (dp_arrange(options, free, shortest=shortest), dp_arrange(options, free, SubtractingOperator())):
        for t in range(shortest if table.lows is not None else 0, len(options) + 1):
            for limit in (None, *range(free + 1)):
                total, units = table.best(t, limit)
                if total == math.inf:
                    continue
                expected = [durations[counts.index(k)] for (counts, durations), k in zip(options, units)]
                assert table.durations(units).tolist() == expected
