"""The name constraints every layer shares: what a task, trajectory, signature, environment or resource may be
called. Kept apart from the request parser so that managers check names without importing the HTTP layer."""

from __future__ import annotations

import re

# \Z, not $: Python's $ also matches before a trailing newline, which would let "task\n" through
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-/]{0,127}\Z")
RESOURCE = re.compile(r"^[a-z][a-z0-9_]*(\.[A-Za-z0-9_\-]+)*\Z")


def json_pattern(pattern: re.Pattern[str]) -> str:
    """The same constraint as a JSON Schema (ECMA-262) pattern, which has no ``\\Z``: its ``$`` ends the input."""
    return pattern.pattern.removesuffix(r"\Z") + "$"
