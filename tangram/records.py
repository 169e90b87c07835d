"""What the broker answers, as typed models: the OpenAPI document's response schemas are generated from them, and the
tests check the records the broker really sends (and the client reads) against them, so the three cannot drift."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from tangram.core.action import Kind, State
from tangram.core.schema import Schema


class MalleableSummary(Schema):
    """An elastic action whose units changed as it ran."""

    resource: str
    floor: int
    workers: int
    resizes: int
    unit_seconds: float
    history: list[tuple[float, int]] = Field(description="[time, units] at each change")


class AllocationRecord(Schema):
    units: dict[str, int]
    placement: dict[str, Any] = Field(description="where the manager put it: node, cores, NUMA nodes, GPU chunk")
    malleable: MalleableSummary | None = None


class ActionErrorRecord(Schema):
    """Why an action failed; a manager may add details beside the code and message."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class Timings(Schema):
    """Seconds; null until known."""

    queue_s: float | None
    execution_s: float | None
    restore_s: float | None
    overhead_s: float | None
    act_s: float | None


class ActionRecord(Schema):
    """An action as the broker holds it (``Action.to_json``)."""

    id: str
    task: str
    trajectory: str | None
    kind: Kind
    state: State
    demand: dict[str, Any] = Field(description="as submitted: units, {min, max} or {choices}")
    elasticity: dict[str, Any] | None
    spec: dict[str, Any]
    timeout_s: float
    idempotency_key: str | None
    signature: str
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    allocation: AllocationRecord | None
    result: Any = Field(description="the kind's result: exit code and output, scores, the upstream's answer, ...")
    error: ActionErrorRecord | None
    timings: Timings
