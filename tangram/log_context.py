"""The action a log line is about, kept in a context variable so that every log call made while the broker handles
that action carries its ids (``tangram/log_format.py`` writes them) without passing them to each call.

asyncio tasks copy the context at creation: bind inside the task (or before creating it) and the binding follows the
action's work, and ends with it, without leaking into other actions'."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType

from tangram.core.action import Action

#: the fields a JSON log line takes from the context, in the order it writes them
FIELDS = ("action", "task", "trajectory", "environment")

_NONE: Mapping[str, str] = MappingProxyType({})
_bound: ContextVar[Mapping[str, str]] = ContextVar("tangram_log_context", default=_NONE)


def action_fields(action: Action) -> dict[str, str]:
    """What is known of ``action`` for a log line: its id and task always, its trajectory and named environment when
    it has them."""
    environment = action.spec.get("environment") if isinstance(action.spec, dict) else None
    fields = {"action": action.id, "task": action.task, "trajectory": action.trajectory,
              "environment": environment if isinstance(environment, str) else None}
    return {key: value for key, value in fields.items() if value is not None}


def current_fields() -> Mapping[str, str]:
    """The fields bound in this context (empty outside any action)."""
    return _bound.get()


@contextmanager
def bound_action(action: Action) -> Iterator[None]:
    """Log lines emitted in this block (and in tasks created in it) carry ``action``'s fields."""
    token = _bound.set(MappingProxyType(action_fields(action)))
    try:
        yield
    finally:
        _bound.reset(token)
