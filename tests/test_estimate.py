from tangram.sched.estimate import CompletionHeap, Waiting, estimate


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
