from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.sched import estimate as estimates
from tangram.sched.estimate import CompletionHeap, SortedUnits, UnitHeap, Waiting, estimate, reach, reachable


def test_take_returns_when_the_last_unit_frees_and_keeps_the_rest():
    heap = CompletionHeap([(0.0, 2), (5.0, 3)])
    assert heap.take(3) == 5.0
    assert heap.units == 2
    assert heap.take(2) == 5.0
    assert heap.take(1) == float("inf")


def test_estimate_simulates_fcfs_on_unit_free_times():
    # two idle units; three waiting one-unit actions of 4 s: finish at 4, 4, 8
    heap = CompletionHeap([(0.0, 2)])
    waiting = [Waiting((1,), (4.0,))] * 3
    assert estimate(heap, waiting, depth=1) == 16.0
    assert heap.units == 2  # the caller's heap is not consumed


def test_depth_lets_the_first_action_scale():
    heap = CompletionHeap([(0.0, 2)])
    waiting = [Waiting((1, 2), (10.0, 5.0))]
    assert estimate(heap, waiting, depth=1) == 10.0
    assert estimate(heap, waiting, depth=2) == 5.0


def test_an_expected_action_counts_from_its_arrival():
    # one idle unit: a queued 2 s action takes it at 0 and ends at 2; one expected at 1 s for 1 s waits for it,
    # runs 2-3, and its ACT counts from its arrival: 2 s
    heap = CompletionHeap([(0.0, 1)])
    queued, arriving = Waiting((1,), (2.0,)), Waiting((1,), (1.0,), arrival_s=1.0)
    assert estimate(heap, [queued, arriving], depth=1) == 2.0 + (3.0 - 1.0)
    # units free before it arrives do not start it early
    assert estimate(CompletionHeap([(0.0, 2)]), [queued, arriving], depth=1) == 2.0 + 1.0


free_times = st.lists(st.tuples(st.integers(0, 12).map(float), st.integers(0, 4)), max_size=10)
waiting_actions = st.builds(
    Waiting,
    st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True).map(lambda c: tuple(sorted(c))),
    st.lists(st.integers(1, 20).map(float), min_size=3, max_size=3).map(tuple),
    st.one_of(st.just(0.0), st.integers(0, 10).map(float)))


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(free_times, min_size=1, max_size=4), skip=st.integers(0, 8),
       waiting=st.lists(waiting_actions, max_size=10), depth=st.integers(1, 3))
def test_an_estimate_over_the_units_it_reaches_is_the_estimate_over_the_whole_heap(runs, skip, waiting, depth):
    """Greedy eviction cuts each run of unit free-times (the first after its ``skip`` earliest went, as the planned
    members take idle units) to the units the estimate can reach: the estimate is the same, bit for bit."""
    whole = CompletionHeap(runs[0])
    first = SortedUnits(runs[0])
    skip = skip if skip <= first.units else 0  # ``take`` of more than the heap holds takes nothing
    whole.take(skip)
    whole.extend(entry for run in runs[1:] for entry in run)
    need = reach(waiting, depth)
    cut = CompletionHeap.of_windows([first.window(skip, need)] + [SortedUnits(run).window(0, need) for run in runs[1:]])
    assert cut.units <= whole.units
    assert estimate(cut, waiting, depth) == estimate(whole, waiting, depth)


@settings(max_examples=300, deadline=None)
@given(entries=st.lists(st.tuples(st.integers(0, 6).map(float), st.integers(0, 4)), max_size=12),
       skip=st.integers(0, 10), units=st.integers(0, 12))
def test_sorted_units_of_a_plan_are_the_sorted_entries(entries, skip, units):
    """A plan's completion times sorted by numpy, ties by units as ``sorted`` breaks them, members given no units
    left out: every window is the one the entries sorted in Python give."""
    times = np.array([time for time, _ in entries], dtype=float)
    counts = [count for _, count in entries]
    assert SortedUnits.of(times, counts).window(skip, units) == SortedUnits(entries).window(skip, units)


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(free_times, min_size=1, max_size=4), skip=st.integers(0, 8),
       waiting=st.lists(waiting_actions, max_size=10), depth=st.integers(1, 3))
def test_an_estimate_on_one_entry_per_unit_is_the_estimate_on_the_whole_heap(runs, skip, waiting, depth):
    """Greedy eviction's heap holds the units the estimate can reach, one float per unit where the waiting actions
    take few units each and (time, count) entries otherwise: the estimate is the same either way, bit for bit."""
    whole = CompletionHeap(runs[0])
    first = SortedUnits(runs[0])
    skip = skip if skip <= first.units else 0
    whole.take(skip)
    whole.extend(entry for run in runs[1:] for entry in run)
    cut = [(first, skip)] + [(SortedUnits(run), 0) for run in runs[1:]]
    expected = estimate(whole, waiting, depth)
    for per_waiting, kind in ((10 ** 6, UnitHeap), (0, CompletionHeap)):
        with mock.patch.object(estimates, "UNITS_PER_WAITING", per_waiting):
            heap = reachable(cut, waiting, depth)
        assert isinstance(heap, kind) or not waiting
        assert estimate(heap, waiting, depth) == expected


def test_a_unit_heap_takes_and_gives_back_as_the_completion_heap():
    entries = [(3.0, 2), (1.0, 1), (5.0, 3)]
    units = UnitHeap(sorted(time for time, n in entries for _ in range(n)))
    heap = CompletionHeap(entries)
    for count, back in ((2, 4.0), (3, 6.0), (7, 1.0)):
        assert units.take(count) == heap.take(count)
        units.put(back, count)
        heap.put(back, count)
        assert units.units == heap.units
    assert units.take(units.units + 1) == heap.take(heap.units + 1) == float("inf")
