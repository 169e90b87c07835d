"""Which modules a ``-m`` expression leaves out before they are imported (``tests/slow_modules.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.slow_modules import left_out

TESTS = Path(__file__).resolve().parent
FAST_LANE = "not (docker or ray or browser or postgres or slow)"


@pytest.mark.parametrize(("module", "markexpr", "ignored"), [
    ("test_api_fuzz.py", FAST_LANE, True),  # marked slow as a whole
    ("test_api_fuzz.py", "not slow", True),
    ("test_api_fuzz.py", "slow", False),
    ("test_api_fuzz.py", "not docker", False),  # some of its tests may need no engine
    ("test_api_fuzz.py", "slow and docker", False),
    ("test_api_fuzz.py", "", False),
    ("test_cycle.py", FAST_LANE, False),  # slow test by test, or not at all: collected
    ("conftest.py", FAST_LANE, False),
])
def test_a_module_marked_slow_as_a_whole_is_left_out_only_where_no_test_of_it_could_be_chosen(
        module: str, markexpr: str, ignored: bool) -> None:
    assert left_out(TESTS / module, markexpr) is ignored
