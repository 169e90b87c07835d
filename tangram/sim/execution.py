"""A CPU call's execution on the virtual clock, as work done at the speed of the cores it holds *now*.

A call first waits out a fixed delay (dispatch, a new sandbox), then does the CPU work of starting its test
runner's workers (``tangram.sim.cluster.startup_cpu_s``), then its true work, each at the rate its current cores
give: ``min(units, workers)`` cores for the start-up, the call's true speed-up on ``min(units, workers)`` for the
work (cores past its workers idle; a runner's workers follow its cores, so ``workers`` is then its cap). When the
scheduler resizes a malleable call, its progress is advanced to that instant and its finish re-timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tangram.sim.trace import Call


@dataclass(slots=True, eq=False)
class Execution:
    call: Call
    workers: int
    units: int
    since: float
    started_s: float
    delay_s: float  # fixed overhead left
    startup_s: float  # CPU seconds of worker start-up left
    work_s: float  # single-core seconds of true work left
    unit_s: float = 0.0  # units held x seconds, up to ``since``
    version: int = 0  # bumped when re-timed: older finish events are stale
    history: list[tuple[float, int]] = field(default_factory=list)  # (instant, units from then on) when resized

    def _usable(self) -> int:
        return max(1, min(self.units, self.workers))

    def advance(self, now: float) -> None:
        elapsed = max(0.0, now - self.since)
        self.unit_s += elapsed * self.units
        self.since = now
        step = min(elapsed, self.delay_s)
        self.delay_s -= step
        elapsed -= step
        if elapsed > 0 and self.startup_s > 0:
            rate = self._usable()
            step = min(elapsed, self.startup_s / rate)
            self.startup_s = max(0.0, self.startup_s - step * rate)
            elapsed -= step
        if elapsed > 0:
            self.work_s = max(0.0, self.work_s - elapsed * self.call.speedup(self._usable()))

    def finish_at(self) -> float:
        usable = self._usable()
        return self.since + self.delay_s + self.startup_s / usable + self.work_s / self.call.speedup(usable)

    def resize(self, units: int, now: float) -> float:
        """Advance to ``now``, hold ``units`` from then on; returns the new finish time."""
        self.advance(now)
        if not self.history:
            self.history.append((self.started_s, self.units))
        self.history.append((now, units))
        self.units = units
        self.version += 1
        return self.finish_at()
