"""Duration profiles learned from completed actions, per (task, action signature).

The scheduler needs ``T1`` (single-unit duration) for scalable actions and an expected duration for the rest
(the paper uses historical averages). We keep an EWMA of the observed duration normalised to one unit:
``T1 ~ exec_time * E(m) * m`` for an elastic action that ran on ``m`` key units, ``exec_time`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from tangram.action import Action


@dataclass(slots=True)
class Profile:
    t1: float
    samples: int


class DurationModel:
    def __init__(self, alpha: float = 0.2, default_s: float = 1.0) -> None:
        self.alpha = alpha
        self.default_s = default_s
        self.profiles: dict[tuple[str, str], Profile] = {}
        self.dirty: set[tuple[str, str]] = set()

    def load(self, task: str, signature: str, t1: float, samples: int) -> None:
        self.profiles[(task, signature)] = Profile(t1, samples)

    def t1(self, action: Action) -> float | None:
        """Declared T1, else learned; None when neither is known."""
        if action.elasticity is not None and action.elasticity.t1 is not None:
            return action.elasticity.t1
        profile = self.profiles.get((action.task, action.signature))
        return None if profile is None else profile.t1

    def scalable(self, action: Action) -> bool:
        """Elastic along a key resource *and* with a known duration: only these enter DPArrange."""
        return action.key_resource is not None and self.t1(action) is not None

    def duration(self, action: Action, units: int | None = None) -> float:
        """Expected execution time on ``units`` of the key resource (its minimum when None)."""
        t1 = self.t1(action)
        if t1 is None:
            return self.default_s
        key = action.key_resource
        if key is None or action.elasticity is None:
            return t1
        m = units if units is not None else action.demands[key].min
        return action.elasticity.duration(t1, m)

    def observe(self, action: Action) -> None:
        """Fold a successful action's execution time into its profile."""
        if action.execution_s is None:
            return
        sample = action.execution_s - (action.restore_s or 0.0)  # a restore depends on placement, not the action
        key = action.key_resource
        if action.malleable is not None and action.started_at is not None:
            sample = action.malleable.work_done(action.started_at + sample)  # its units changed as it ran
        elif key is not None and action.elasticity is not None and key in action.units:
            m = action.units[key]
            sample *= action.elasticity.efficiency_at(m) * m
        ident = (action.task, action.signature)
        profile = self.profiles.get(ident)
        if profile is None:
            self.profiles[ident] = Profile(sample, 1)
        else:
            profile.t1 += self.alpha * (sample - profile.t1)
            profile.samples += 1
        self.dirty.add(ident)

    def take_dirty(self) -> list[tuple[str, str, float, int]]:
        """Profiles changed since the last call, for the store to persist."""
        rows = [(task, sig, self.profiles[(task, sig)].t1, self.profiles[(task, sig)].samples)
                for task, sig in self.dirty]
        self.dirty.clear()
        return rows
