"""What each reward service asks of the GPUs, measured while the broker runs: the input of the live placement
(``managers/gpu/live_placement.py``) and of the typed fit (issue 18).

Two figures per service, both learned from the actions themselves, so that neither depends on how well the service
is being served now (a starved service's completions fall; its arrivals do not):

- its **arrival rate**: reward actions queued per second, an exponentially weighted count with time constant
  ``window_s`` (corrected for the time since the first arrival, at least a second, so a young broker is not read
  as idle);
- its **run seconds per GPU type**: an EWMA of each successful action's execution less its restore, on the type of
  the node it ran on, in GPU-seconds (seconds times the DoP). Before a type has been seen, the service's figure on
  the types seen is carried over by the cost model's speed ratio (``gpu_types.speed``); before any, ``PRIOR_GPU_S``.

The load the placement wants, GPU-seconds per second on the reference type, is the arrival rate times the run
GPU-seconds per action on that type; the speed of a type for a service is the reference's seconds over the type's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from managers.gpu.gpu_types import REFERENCE_TYPE, Bound, GpuType, speed
from tangram.core.action import Action, Kind

#: weight of each observed action in a (service, type)'s run seconds
RUN_EWMA_ALPHA = 0.2
#: the least run an action is learned as: a speed ratio divides by it
MIN_GPU_S = 1e-6
#: ASSUMED: GPU-seconds per action on the reference type before any action of the service has ended; only the
#: ratios between services steer a placement, and the first ends replace it
PRIOR_GPU_S = 1.0


@dataclass
class _Arrivals:
    """An exponentially weighted count: ``weight`` as of ``at``, arrivals since ``first``."""

    first: float
    at: float
    weight: float = 0.0

    def add(self, now: float, window_s: float) -> None:
        self.weight = self.decayed(now, window_s) + 1.0
        self.at = max(self.at, now)

    def decayed(self, now: float, window_s: float) -> float:
        return self.weight * math.exp(-max(now - self.at, 0.0) / window_s)

    def rate(self, now: float, window_s: float) -> float:
        """Arrivals per second: the weighted count over the weight the window has had time to build up."""
        span = max(now - self.first, 0.0)
        covered = window_s * -math.expm1(-span / window_s) if span > 0 else 0.0
        return self.decayed(now, window_s) / max(covered, 1.0)


class ServiceDemand:
    """Arrival rates and run seconds per GPU type of the reward services; told of actions as a broker watcher."""

    def __init__(self, service_of: Callable[[Action], str], node_type: Callable[[str], str | None],
                 types: Mapping[str, GpuType], bounds: dict[str, Bound], window_s: float,
                 resource: str = "gpu") -> None:
        """``service_of``: a reward action's service; ``node_type``: a GPU node's type (None for a node unknown);
        ``bounds``: each service's bound for the speed prior (absent: compute); ``resource``: the GPUs' name in an
        action's units and placement."""
        self._service_of = service_of
        self._node_type = node_type
        self.types = types
        self.bounds = bounds
        self.window_s = window_s
        self._resource = resource
        self._arrivals: dict[str, _Arrivals] = {}
        #: service -> type -> GPU-seconds per action, for the types its actions have run on
        self._gpu_s: dict[str, dict[str, float]] = {}

    # -- the broker's watcher -------------------------------------------------------------------------------

    def submitted(self, action: Action) -> None:
        if action.kind is not Kind.REWARD:
            return
        service, now = self._service_of(action), action.submitted_at
        arrivals = self._arrivals.setdefault(service, _Arrivals(first=now, at=now))
        arrivals.add(now, self.window_s)

    def ended(self, action: Action) -> None:
        """Learn the run GPU-seconds of a successful reward action on its node's type."""
        if action.kind is not Kind.REWARD or action.error is not None or action.execution_s is None:
            return
        where = action.placement.get(self._resource)
        units = action.units.get(self._resource)
        kind = self._node_type(where["node"]) if isinstance(where, dict) and "node" in where else None
        if kind is None or not units:
            return
        seconds = max(action.execution_s - (action.restore_s or 0.0), MIN_GPU_S) * units
        learned = self._gpu_s.setdefault(self._service_of(action), {})
        before = learned.get(kind)
        learned[kind] = seconds if before is None else before + RUN_EWMA_ALPHA * (seconds - before)

    # -- what the placement and the fit read ----------------------------------------------------------------

    def rate(self, service: str, now: float) -> float:
        """Reward actions of ``service`` queued per second lately."""
        arrivals = self._arrivals.get(service)
        return arrivals.rate(now, self.window_s) if arrivals is not None else 0.0

    def gpu_s(self, service: str, kind: str) -> float:
        """GPU-seconds one action of ``service`` runs on a GPU of type ``kind``: learned there, else carried over
        from the types learned by the speed prior, else the prior."""
        learned = self._gpu_s.get(service, {}).get(kind)
        if learned is not None:
            return learned
        return self.reference_gpu_s(service) / self._prior_speed(service, kind)

    def reference_gpu_s(self, service: str) -> float:
        """GPU-seconds per action on the reference type: learned there, else the mean of the types learned, each
        brought to the reference by its prior speed, else ``PRIOR_GPU_S``."""
        learned = self._gpu_s.get(service, {})
        if REFERENCE_TYPE in learned:
            return learned[REFERENCE_TYPE]
        seen = [seconds * self._prior_speed(service, kind) for kind, seconds in learned.items()]
        return sum(seen) / len(seen) if seen else PRIOR_GPU_S

    def speed(self, service: str, kind: str) -> float:
        """How many times faster ``service`` runs on ``kind`` than on the reference type, as measured where both
        have been (or one of them carried over by the prior)."""
        return self.reference_gpu_s(service) / self.gpu_s(service, kind)

    def load(self, service: str, now: float) -> float:
        """GPU-seconds per second ``service`` asks of the reference type: what the placement serves."""
        return self.rate(service, now) * self.reference_gpu_s(service)

    def learned(self) -> dict[str, dict[str, float]]:
        """service -> type -> GPU-seconds per action, for the types actions have run on (``/metrics``, status)."""
        return {service: dict(learned) for service, learned in self._gpu_s.items()}

    def _prior_speed(self, service: str, kind: str) -> float:
        reference = self.types[REFERENCE_TYPE]
        return speed(self.types.get(kind, reference), reference, self.bounds.get(service, "compute"))
