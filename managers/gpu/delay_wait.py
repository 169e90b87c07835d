"""Delay scheduling's timers (Zaharia et al., EuroSys 2010), for placements that a setup would make costly.

An action that could start now only where it would first pay a setup (a restore onto the GPUs, a load from disk),
while its service is ready elsewhere but busy, is *deferred*: the actions behind it go first, and one whose
service is ready on the free chunk takes it without a setup. Once the deferred action has waited as long as the
setup it avoids would take, counted from the first pass that deferred it, it takes its place in the queue again:
so waiting costs an action at most what the setup would, and each chunk keeps serving the service it holds instead
of switching with every placement.
"""

from __future__ import annotations

from collections.abc import Callable

#: an action no pass deferred for this long is forgotten (placed, cancelled or failed)
FORGET_WAIT_S = 600.0


class DelayWaits:
    """Each deferred action's wait, and when the first of them may stop waiting."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        #: actions waiting: since when, and when a pass last deferred them
        self._waiting: dict[str, tuple[float, float]] = {}
        #: when the first action deferred by the last pass may take a chunk that needs a setup
        self._wait_until: float | None = None

    def new_pass(self) -> None:
        """A scheduling pass begins; actions no pass deferred for ``FORGET_WAIT_S`` are forgotten (gone)."""
        now = self._clock()
        if any(now - seen > FORGET_WAIT_S for _, seen in self._waiting.values()):
            self._waiting = {key: value for key, value in self._waiting.items() if now - value[1] <= FORGET_WAIT_S}
        self._wait_until = None

    def worth_waiting(self, action_id: str, patience_s: float) -> bool:
        """Whether the action waits rather than pay a setup of ``patience_s``: until it has waited that long since
        the first pass that deferred it. Past that it takes its place in the queue like any other action (still
        deferred, it could see the actions behind it take every free chunk, pass after pass)."""
        now = self._clock()
        since = self._waiting.get(action_id, (now, now))[0]
        until = since + patience_s
        if now >= until:
            self._waiting.pop(action_id, None)
            return False
        self._waiting[action_id] = (since, now)
        self._wait_until = min(until, self._wait_until or until)
        return True

    def forget(self, action_id: str) -> None:
        """The action has nothing to wait for (no node is ready for it)."""
        self._waiting.pop(action_id, None)

    def next_change_in(self) -> float | None:
        """Until the first action deferred by the last pass may take an idle chunk that needs a setup (a pass then
        places it, even if nothing else happens by then)."""
        return None if self._wait_until is None else max(0.0, self._wait_until - self._clock())
