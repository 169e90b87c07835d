"""Seconds an operation takes per key (a service's restore, its load from disk), learned from the ones observed:
the first observation sets it, later ones move it by an exponentially weighted average; a prior until then."""

from __future__ import annotations

from collections.abc import Callable


class LearnedSeconds:
    def __init__(self, prior_s: Callable[[str], float], alpha: float) -> None:
        """``prior_s(key)``: the estimate before any observation; ``alpha``: the weight of each new one."""
        self._prior_s = prior_s
        self._alpha = alpha
        self._learned: dict[str, float] = {}

    def observe(self, key: str, seconds: float) -> None:
        before = self._learned.get(key)
        self._learned[key] = seconds if before is None else before + self._alpha * (seconds - before)

    def estimate(self, key: str) -> float:
        learned = self._learned.get(key)
        return learned if learned is not None else self._prior_s(key)
