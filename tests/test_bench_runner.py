"""``loadtest.bench_runner``'s bookkeeping: which runs it makes, how it reads pytest's counts, and that a run whose
counts or exit code differ from plain pytest's, or a runner run that did not fork, fails the bench."""

from __future__ import annotations

from loadtest.bench_runner import SHORT_SUMMARY, Config, Ran, counts_of, plan, report

PLAIN = Config("plain", 1, 1)
RUNNER_2 = Config("tangram", 2, 2)
XDIST_2 = Config("xdist", 2, 2)
GROWN = Config("tangram", 1, 1, grow_to=2)
FORKED = "tangram-runner: 2 worker(s) forked after one collection"


def test_counts_are_read_from_the_last_summary_line() -> None:
    output = ("tests/test_a.py ..F.s [100%]\n= FAILURES =\nassert 1 passed in here\n"
              "=========== 8 failed, 1799 passed, 2 skipped, 1 xfailed, 3 errors in 21.95s ===========\n")
    assert counts_of(output) == {"failed": 8, "passed": 1799, "skipped": 2, "xfailed": 1, "errors": 3}
    assert counts_of("1 error in 0.10s") == {"errors": 1}
    assert counts_of("collected nothing") == {}
    summary = "x FAILED tests/test_e.py\nFAILED tests/test_a.py::T::test_b - Exception: mu...\nERROR tests/test_c.py::d\n"
    assert SHORT_SUMMARY.findall(summary) == ["tests/test_a.py::T::test_b", "tests/test_c.py::d"]


def test_the_plan_covers_each_width_and_grows_only_within_the_cores() -> None:
    labels = [c.label for c in plan(4, [(1, 2), (4, 16)])]
    assert labels == ["plain", "tangram 1c/1w", "tangram 1c/2w", "xdist 1c/2w", "xdist 2c/2w", "tangram 2c/2w",
                      "xdist 4c/4w", "tangram 4c/4w", "grown 1->2"]
    assert [c.label for c in plan(2, [], one_core=False, parallex=True)] == [
        "plain", "xdist 2c/2w", "tangram 2c/2w", "parallex 2c/2w"]
    assert [c.label for c in plan(2, [], one_core=False, long_tests=True)] == [
        "plain", "xdist 2c/2w", "tangram 2c/2w", "tangram 2c/2w long known"]
    wide = [c.label for c in plan(16, [(4, 16)], one_core=False)]
    assert wide[0] == "plain" and "tangram 1c/1w" not in wide and wide[-1] == "grown 4->16"


def test_parity_and_forking_are_checked_in_every_run() -> None:
    same = {"passed": 10, "skipped": 1}
    runs = {PLAIN: [Ran(10.0, 0, same, ""), Ran(12.0, 0, same, "")],
            XDIST_2: [Ran(6.0, 0, same, "")],
            RUNNER_2: [Ran(5.0, 0, same, FORKED)],
            GROWN: [Ran(8.0, 0, same, FORKED)],
            Config("parallex", 2, 2): [Ran(5.5, 0, same, "")],
            Config("tangram", 1, 1): [Ran(10.0, 0, same, FORKED)]}
    figures = report({"suite": runs}, [PLAIN])
    row = figures["suites"]["suite"]
    assert figures["parity"] and figures["runner_ran"]
    assert row["speedup"]["tangram 2c/2w"] == 11.0 / 5.0 and row["runner_over_xdist"] == {"2c": 6.0 / 5.0}
    assert row["grown_over_staying"] == {"grown 1->2": 0.8} and row["runner_over_parallex"] == {"2c": 5.5 / 5.0}
    assert row["long_known_over_unknown"] == {} and row["long_known_over_xdist"] == {}
    runs[Config("tangram", 2, 2, long_known=True)] = [Ran(4.0, 0, same, FORKED)]
    row = report({"suite": runs}, [PLAIN])["suites"]["suite"]
    assert row["runner_over_xdist"] == {"2c": 6.0 / 5.0}  # a run given long tests is not the runner's first
    assert row["long_known_over_unknown"] == {"2c": 5.0 / 4.0} and row["long_known_over_xdist"] == {"2c": 6.0 / 4.0}

    runs[RUNNER_2].append(Ran(5.0, 0, {"passed": 9, "skipped": 1, "failed": 1}, FORKED, frozenset({"t::x"})))
    runs[GROWN].append(Ran(8.0, 0, same, "tangram-runner: plain pytest (1 thread(s) alive after collection)"))
    figures = report({"suite": runs}, [PLAIN])
    assert not figures["parity"] and figures["suites"]["suite"]["parity_mismatch"] == ["tangram 2c/2w"]
    assert figures["suites"]["suite"]["flipped"] == ["t::x"]
    assert not figures["runner_ran"] and figures["suites"]["suite"]["runner_did_not_fork"] == ["grown 1->2"]
