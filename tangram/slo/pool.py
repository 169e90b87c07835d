"""What SLO admission sees of the GPU pool: no more than it plans with, so it never reaches into the GPU manager."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from reward_services.backend import ServiceSpec
from tangram.core.action import Action


class GpuPool(Protocol):
    #: the resource name the pool's units are counted in (the reserved shares' and the tracker's)
    resource: str

    def gpus_in_service(self) -> int:
        """The GPUs of the nodes in service (a lost node's do not count)."""

    def expected_restore_s(self, adding: Sequence[ServiceSpec] = ()) -> dict[str, float]:
        """Each service's expected restore now; ``adding``: services a reload would add (no restore of theirs
        has been seen)."""

    def service_of(self, action: Action) -> str:
        """The reward service a reward action calls."""
