"""The scheduler profile: which plugin each extension point of the cycle runs, and each plugin's arguments.

The broker reads it from ``[scheduler]`` and its ``[scheduler.<plugin>]`` tables; the simulator takes it beside a
cluster (``tangram simulate --config``), and both build their ``Cycle`` from it, so a deployed configuration and
its simulation run the same pass. Only the queue order has a choice of plugins (FCFS, HRRS); the scheduler
(Algorithm 1, ``elastic``) and the estimates learned from actions' ends have arguments but no alternative. The queue
filters (task caps, allocation back-off) and the reserve order (SLO reservations) take neither: they are not here.

A key that ``[scheduler]`` held before the profile is refused with the place it moved to (``refuse_moved``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, Strict

from tangram.core.config_tables import TABLE, Count, Flag, NonNegative, Seconds
from tangram.core.errors import ConfigError

#: the queue orders: as submitted (``queue.FCFSQueue``), or setup-aware (``setup_order.SetupAwareOrder``)
QueueOrder = Literal["fcfs", "hrrs"]


@dataclass(frozen=True)
class HrrsArgs:
    """``[scheduler.hrrs]``, read where a resource's queue order is HRRS: an action is overdue, and goes ahead of
    those that are not, once it has waited twice the mean wait of the actions queued with it, but at least
    ``overdue_floor_s`` and at most ``max_wait_s`` (the starvation bound)."""

    __pydantic_config__ = TABLE

    max_wait_s: Seconds = 60.0
    overdue_floor_s: Seconds = 10.0


@dataclass(frozen=True)
class ElasticArgs:
    """``[scheduler.elastic]``: the scheduler, Algorithm 1 with Algorithm 2's estimate (``scheduler.py``)."""

    __pydantic_config__ = TABLE

    #: unit counts the first waiting action may try
    depth: Count = 2
    #: waiting actions the ACT estimate simulates per pass
    horizon: NonNegative = 64
    #: a pool's spare units go to its malleable actions by summed speed-up, or ``"remaining"``: by speed-up over
    #: remaining work (heSRPT-like; the simulator's ``tangram-srpt`` ablation)
    share_by: Literal["speedup", "remaining"] = "speedup"


@dataclass(frozen=True)
class EstimateArgs:
    """``[scheduler.estimates]``: what the passes learn from actions' ends (``durations.py``, ``arrivals.py``)."""

    __pydantic_config__ = TABLE

    #: expected duration of an action nothing is known about
    default_duration_s: Seconds = 1.0
    #: weight of a new observation in the learned durations and arrivals
    ewma_alpha: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.2
    #: the estimate also counts the actions idle trajectories are expected to submit next (false: the queue alone,
    #: as the paper's Algorithm 2)
    arrivals: Flag = True


@dataclass(frozen=True)
class SchedulerProfile:
    """The plugins of the cycle's extension points and their arguments (``[scheduler]``)."""

    __pydantic_config__ = TABLE

    #: every resource's queue order ...
    queue_order: QueueOrder = "fcfs"
    #: ... but these resources' (``{gpu = "hrrs"}``: reward actions of resident services first)
    queue_order_by_resource: Mapping[str, QueueOrder] = field(default_factory=dict)
    hrrs: HrrsArgs = field(default_factory=HrrsArgs)
    elastic: ElasticArgs = field(default_factory=ElasticArgs)
    estimates: EstimateArgs = field(default_factory=EstimateArgs)

    def ordered_by(self, order: QueueOrder, resources: Iterable[str]) -> list[str]:
        """Those of ``resources`` whose queue order is ``order``."""
        return [r for r in resources if self.queue_order_by_resource.get(r, self.queue_order) == order]

    def to_json(self) -> dict[str, Any]:
        """The profile as its ``[scheduler]`` tables spell it (what a simulation reports it ran)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(SchedulerProfile)}


#: the broker's profile when ``[scheduler]`` sets nothing
DEFAULT_PROFILE = SchedulerProfile()


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return dict(value) if isinstance(value, Mapping) else value


#: the keys ``[scheduler]`` held before the profile, and where each went
MOVED = {
    "policy": "[scheduler] queue_order (\"fcfs\" or \"hrrs\": every resource's order)",
    "order": "[scheduler] queue_order_by_resource (e.g. {gpu = \"hrrs\"})",
    "max_wait_s": "[scheduler.hrrs] max_wait_s (HRRS's starvation bound; [server] max_wait_s stays the longest "
                  "?wait=true)",
    "overdue_floor_s": "[scheduler.hrrs] overdue_floor_s",
    "depth": "[scheduler.elastic] depth",
    "horizon": "[scheduler.elastic] horizon",
    "default_duration_s": "[scheduler.estimates] default_duration_s",
    "ewma_alpha": "[scheduler.estimates] ewma_alpha",
}


def refuse_moved(raw: Any) -> None:
    """Name where an older config's ``[scheduler]`` key went, rather than calling it unknown."""
    if not isinstance(raw, dict):
        return
    for key, now in MOVED.items():
        if key in raw:
            raise ConfigError(f"scheduler.{key}", f"moved with the scheduler profile: now {now}")
