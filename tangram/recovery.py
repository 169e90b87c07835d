"""Crash recovery: what a broker starting up does with the actions a previous run of it left unfinished.

Queued actions queue again in their old order, under their deadlines and idempotency keys. Actions that were
running cannot be re-attached (their results went to the dead process): they end ``failed`` with
``broker_restarted``, which tells the client that their effects are unknown. A queued action the new config can
no longer run (its resource was removed) ends ``failed`` with ``not_runnable``. Granted leases are
``tangram.leases``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tangram.core.action import Action, State
from tangram.core.errors import RequestError, Unavailable

BROKER_RESTARTED = {"code": "broker_restarted",
                    "message": "the broker restarted while this action ran; whether it took effect is unknown. "
                               "Resubmit under a new idempotency_key if running it again is safe"}


@dataclass
class Triage:
    """The unfinished actions sorted: those to queue again (in submission order) and those to end failed."""

    resumed: list[Action] = field(default_factory=list)
    ended: list[tuple[Action, dict[str, str]]] = field(default_factory=list)


def triage(unfinished: Iterable[Action], check_runnable: Callable[[Action], None]) -> Triage:
    """Sort ``unfinished`` (submission order); ``check_runnable`` raises a ``RequestError`` for an action this
    broker's managers refuse (``Unavailable`` only for now, so that one waits). A running action's units and
    placement are cleared: nothing is held in this process."""
    sorted_out = Triage()
    for action in unfinished:
        if action.state is State.RUNNING:
            action.units, action.placement = {}, {}
            sorted_out.ended.append((action, dict(BROKER_RESTARTED)))  # each record its own error
            continue
        try:
            check_runnable(action)
        except Unavailable:  # nothing serves it now (its nodes join or come back later): it waits in the queue
            pass
        except RequestError as error:  # the config changed under it: it could never run here
            sorted_out.ended.append((action, {"code": "not_runnable",
                                              "message": f"after a restart: {error.field}: {error.reason}"}))
            continue
        sorted_out.resumed.append(action)
    return sorted_out
