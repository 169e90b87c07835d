"""How large an executor's answer may be (``sandboxes/executor_answer.py``): a frame beyond what an honest executor
sends for the request is refused before it is read."""

from __future__ import annotations

from sandboxes.executor import DEFAULT_OUTPUT_LIMIT
from sandboxes.executor_answer import FRAME_OVERHEAD_BYTES, frame_limit, payload_limit


def test_the_frame_limit_follows_the_request() -> None:
    assert frame_limit({"op": "ping"}) == FRAME_OVERHEAD_BYTES
    assert frame_limit({"op": "run", "output_limit": 1000}) == FRAME_OVERHEAD_BYTES + 12_000
    assert frame_limit({"command": "true"}) == FRAME_OVERHEAD_BYTES + 12 * DEFAULT_OUTPUT_LIMIT


def test_only_a_read_is_answered_with_raw_bytes_up_to_its_limit() -> None:
    assert payload_limit({"op": "read", "limit": 1000}) == 1000
    assert payload_limit({"op": "read", "limit": "1000"}) == 0
    assert payload_limit({"op": "write", "limit": 1000}) == payload_limit({"command": "true"}) == 0
