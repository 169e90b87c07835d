"""The tests' outcome as one signed line, the only thing a test-scored reward believes of a sandbox's output.

Everything else a test run prints can come from the solution (it can write to the executor's pipes, or print a
pytest summary of its own). The reward puts a fresh random key in the sandbox as ``KEY_FILE``; the pytest plugin
(``tangram_client/reward_report.py``) reads and deletes it before any solution code exists, keeps it in a process the
solution cannot read, and prints ``MARKER <json> <hmac-sha256>`` at the end. A line whose MAC does not check is
ignored, so the solution can hide the report (a score of 0) but never write one. Shipped into the sandbox: stdlib
only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping

MARKER = "TANGRAM-REWARD-REPORT"
#: the key's file, in the directory pytest starts in
KEY_FILE = ".tangram-reward-key"
#: the counts a report carries
FIELDS = ("collected", "passed", "failed", "skipped")


def _mac(key: bytes, payload: str) -> str:
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def signed_line(key: bytes, counts: Mapping[str, int]) -> str:
    """The report line (no newline) for ``counts`` (every one of ``FIELDS``)."""
    payload = json.dumps({field: int(counts[field]) for field in FIELDS}, sort_keys=True, separators=(",", ":"))
    return f"{MARKER} {payload} {_mac(key, payload)}"


def read_signed(text: str, key: bytes) -> dict[str, int] | None:
    """The counts of the first line of ``text`` signed with ``key``, or None when there is none."""
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != MARKER or not hmac.compare_digest(parts[2], _mac(key, parts[1])):
            continue
        counts = json.loads(parts[1])
        return {field: int(counts[field]) for field in FIELDS}
    return None
