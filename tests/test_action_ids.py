"""Action ids: the same form as ever (``act_`` and 24 hex digits), and ordered by when they were made, so that the
store's indexes on ids take each commit's rows in a few pages."""

from __future__ import annotations

import re
import time

from tangram.core.action import new_action_id


def test_ids_keep_their_form_and_are_distinct() -> None:
    ids = [new_action_id() for _ in range(20_000)]
    assert all(re.fullmatch(r"act_[0-9a-f]{24}", action_id) for action_id in ids)
    assert len(set(ids)) == len(ids)


def test_an_id_made_in_a_later_millisecond_sorts_after() -> None:
    earlier = [new_action_id() for _ in range(100)]
    time.sleep(0.003)
    later = [new_action_id() for _ in range(100)]
    assert max(earlier) < min(later)
