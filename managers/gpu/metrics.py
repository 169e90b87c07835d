"""The GPU manager's own Prometheus metrics: its switches' restores and evictions, the disk tier's loads, and the
placement in force."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from managers.gpu.live_placement import LivePlacement, PlacementCollector
from tangram.core.seam import MetricsRegistry

RESTORE_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class SwitchMetrics:
    """What a switch counts (``managers/gpu/switch.py``), by node, service and DoP or stage."""

    restores: Counter
    evictions: Counter
    restore_seconds: Histogram
    restore_stage_seconds: Histogram


def register_gpu_metrics(registry: MetricsRegistry, live: LivePlacement | None) -> tuple[SwitchMetrics, Counter]:
    """Made and added to ``registry``: the switches' metrics and the disk tier's count of host loads."""
    labels = ["node", "service", "dop"]
    switch = SwitchMetrics(
        restores=Counter("tangram_gpu_restores", "Service restores from host memory to GPUs", labels, registry=None),
        evictions=Counter("tangram_gpu_evictions", "Services evicted from GPUs (host copy kept)", labels,
                          registry=None),
        restore_seconds=Histogram("tangram_gpu_restore_seconds", "Time to restore a service to its GPUs", labels,
                                  buckets=RESTORE_SECONDS, registry=None),
        restore_stage_seconds=Histogram(
            "tangram_gpu_restore_stage_seconds", "A restore's stages: disk_to_host (the time it waited for its "
            "host copy to load from the disk tier) and host_to_gpu", ["node", "service", "stage"],
            buckets=RESTORE_SECONDS, registry=None))
    host_loads = Counter(
        "tangram_gpu_host_loads", "Host copies loaded from the disk tier, by what asked (a restore waiting for it, "
        "or prefetch)", ["node", "service", "cause"], registry=None)
    for metric in (switch.restores, switch.evictions, switch.restore_seconds, host_loads,
                   switch.restore_stage_seconds):
        registry.register(metric)
    if live is not None:
        registry.register(PlacementCollector(live))
    return switch, host_loads
