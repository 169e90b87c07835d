"""The broker as the views show it (``GET /v1/resources``, the status page, ``tangram status``): rows of capacity and
use per pool, and counts with recent ACT percentiles."""

from __future__ import annotations

from typing import Any

from tangram.broker import Broker


def resource_rows(broker: Broker) -> list[dict[str, Any]]:
    """One row per manager's pool, with the actions queued for its resource."""
    depth = broker.queue.depth_by_resource()
    return [{"resource": row.resource, "pool": row.pool, "manager": manager.name, "capacity": row.capacity,
             "in_use": row.in_use, "queued": depth.get(row.resource, 0), **row.extra}
            for manager in broker.managers for row in manager.status()]


def broker_stats(broker: Broker) -> dict[str, Any]:
    """Counts, and the ACT percentiles of the last actions that ended."""
    acts = sorted(broker.memory.recent_acts)

    def pct(q: float) -> float | None:
        return acts[min(len(acts) - 1, int(q * len(acts)))] if acts else None

    return {"queued": len(broker.queue), "running": len(broker.running), "leases": len(broker.leases),
            "recent": len(acts), "act_p50_s": pct(0.5), "act_p90_s": pct(0.9), "act_p99_s": pct(0.99)}
