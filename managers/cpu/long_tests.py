"""The tests an action signature's runs found long under the runner: no slice of its next run waits behind them.

Why: the runner's workers pull slices of consecutive tests in collection order, and a worker asks for its next
slice as it starts the last test of the one it has, so that slice waits behind that test; a long test late in
collection order or with a slice behind it (mpmath: a 25 s test of a 56 s suite, in its middle) leaves one worker
running while the others are idle. The runner prints each run's long tests (``--tangram-long-tests``); the CPU
manager keeps them per (task, signature) and gives them to the next run of that signature in the runner's
environment variable: it starts their modules first, ends a slice at a long test and answers the ask before one
with a single test.

The line comes from a sandbox's output, so it is read as untrusted input: a bounded JSON object of node ids to
finite seconds, anything else dropped. It only changes which worker runs which of that signature's own tests (a node
id the next suite does not have is ignored), is kept in memory and lost on a restart: a hint, never a record.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict

#: the line the runner prints with ``--tangram-long-tests`` (its LONG_TESTS_LINE)
LONG_TESTS_LINE = "tangram-runner-long-tests:"
#: the environment variable the runner reads them from (its LONG_TESTS_ENV)
LONG_TESTS_ENV = "TANGRAM_RUNNER_LONG_TESTS"
#: tests kept per signature, the longest (the runner names 32 per run; runs of different suites under one
#: signature add theirs)
TESTS_KEPT = 64
#: signatures kept, the least recently run dropped first
SIGNATURES_KEPT = 4096
MAX_NODEID_CHARS = 1024
#: a longer line is not read (TESTS_KEPT node ids of MAX_NODEID_CHARS fit)
MAX_LINE_CHARS = TESTS_KEPT * (MAX_NODEID_CHARS + 32)
#: a time above this is not believed (a week)
MAX_SECONDS = 7 * 86400.0


def long_tests_from(stdout: str) -> dict[str, float]:
    """The long tests the runner's line in ``stdout`` names, validated: node id -> seconds, at most TESTS_KEPT;
    empty where the line is missing, cut off or malformed."""
    lines = [line for line in stdout.splitlines() if line.startswith(LONG_TESTS_LINE)]
    if not lines or len(lines[-1]) > MAX_LINE_CHARS:
        return {}
    try:
        given = json.loads(lines[-1][len(LONG_TESTS_LINE):])
    except ValueError:
        return {}
    if not isinstance(given, dict):
        return {}
    kept: dict[str, float] = {}
    for nodeid, seconds in given.items():
        if len(kept) == TESTS_KEPT:
            break
        if (0 < len(nodeid) <= MAX_NODEID_CHARS and not nodeid.startswith("/") and nodeid.isprintable()
                and isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
                and 0 <= seconds <= MAX_SECONDS):
            kept[nodeid] = float(seconds)
    return kept


class LongTests:
    """The longest tests seen per (task, signature), the newest run's figure for each."""

    def __init__(self, signatures_kept: int = SIGNATURES_KEPT, tests_kept: int = TESTS_KEPT) -> None:
        self.signatures_kept = signatures_kept
        self.tests_kept = tests_kept
        self._tests: OrderedDict[tuple[str, str], dict[str, float]] = OrderedDict()

    def learn(self, key: tuple[str, str], tests: dict[str, float]) -> None:
        if not tests:
            return
        merged = {**self._tests.pop(key, {}), **tests}
        self._tests[key] = dict(sorted(merged.items(), key=lambda entry: -entry[1])[:self.tests_kept])
        while len(self._tests) > self.signatures_kept:
            self._tests.popitem(last=False)

    def hint(self, key: tuple[str, str]) -> dict[str, float]:
        """What the next run of ``key`` gets (empty: nothing learned yet)."""
        tests = self._tests.get(key)
        if tests is None:
            return {}
        self._tests.move_to_end(key)
        return dict(tests)
