"""The name constraints every layer shares: what a task, trajectory, signature, environment or resource may be
called. Kept apart from the request parser so that managers check names without importing the HTTP layer."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from tangram.core.schema import explained

# \Z, not $: Python's $ also matches before a trailing newline, which would let "task\n" through
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-/]{0,127}\Z")
RESOURCE = re.compile(r"^[a-z][a-z0-9_]*(\.[A-Za-z0-9_\-]+)*\Z")


def json_pattern(pattern: re.Pattern[str]) -> str:
    """The same constraint as a JSON Schema (ECMA-262) pattern, which has no ``\\Z``: its ``$`` ends the input."""
    return pattern.pattern.removesuffix(r"\Z") + "$"


NAME_REASON = "must be 1-128 characters of letters, digits and ._:-/, starting alphanumeric"
#: a task, trajectory or environment id in a typed request
Name = Annotated[str, Field(pattern=explained(json_pattern(NAME), NAME_REASON), description=NAME_REASON)]
