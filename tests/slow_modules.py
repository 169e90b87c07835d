"""Test modules that a ``-m`` expression leaves out whole are not collected at all.

Collecting a module costs its imports and whatever its parametrisation builds; schemathesis builds its coverage cases
at collection (half a minute here), which the fast lane would pay for tests it then deselects. A module marked slow
as a whole says so with ``pytestmark = pytest.mark.slow`` at its top; when the expression is false for a slow test
whatever the other markers (``needs.NEEDS``) are, the module is ignored before it is imported.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path

from _pytest.mark.expression import Expression

from tests.needs import NEEDS

WHOLLY_SLOW = re.compile(r"^pytestmark = pytest\.mark\.slow\b", re.MULTILINE)


def left_out(path: Path, markexpr: str) -> bool:
    """Whether ``markexpr`` deselects every test of the module at ``path`` (a module marked slow as a whole)."""
    if not markexpr or path.suffix != ".py" or not path.name.startswith("test_"):
        return False
    if not WHOLLY_SLOW.search(path.read_text()):
        return False
    expression = Expression.compile(markexpr)
    return not any(expression.evaluate(_marked_with({"slow", *needs}))
                   for count in range(len(NEEDS) + 1) for needs in itertools.combinations(NEEDS, count))


def _marked_with(markers: set[str]) -> Callable[..., bool]:
    return lambda name, /, **kwargs: name in markers
