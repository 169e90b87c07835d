"""What the broker answers and stores, as typed models: the OpenAPI document's response schemas are generated from
them, the tests check the records the broker really sends (and the client reads) against them, and the store reads
its records back through them (``StoredAction``, the store's codec), so the four cannot drift."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ConfigDict, Field, TypeAdapter

from tangram.core.action import Action, Demand, Elasticity, Kind, State
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


class InternalRecord(Schema):
    """What the broker keeps beside an action's record for itself; never sent to a client."""

    seq: int = 0
    execution_s: float | None = None
    expected_duration_s: float | None = None


class StoredAction(ActionRecord):
    """An action as the store keeps it: its record plus ``_internal``. Records were checked when submitted, so no
    request limit applies here: a record beyond today's limits still loads."""

    internal: InternalRecord = Field(default_factory=InternalRecord, alias="_internal")


_STORED = TypeAdapter(StoredAction)
#: numpy numbers in a result (a reward model's) are written as numbers
_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def stored_record(action: Action) -> str:
    """The JSON the store keeps for ``action``: its client record plus the internal fields ``to_json`` leaves out.
    Raises ``TypeError`` (or ``orjson.JSONEncodeError``) for a result that is not JSON."""
    record = action.to_json()
    record["_internal"] = {"seq": action.seq, "execution_s": action.execution_s,
                           "expected_duration_s": action.expected_duration_s}
    return orjson.dumps(record, option=_JSON_OPTIONS).decode()


def action_from_stored(record: str | bytes) -> Action:
    """Rebuild an Action exactly from ``stored_record`` output."""
    stored = _STORED.validate_json(record)
    action = Action(task=stored.task, kind=stored.kind,
                    demands={name: Demand.from_json(value) for name, value in stored.demand.items()},
                    spec=stored.spec, trajectory=stored.trajectory,
                    elasticity=None if stored.elasticity is None else Elasticity.from_json(stored.elasticity),
                    timeout_s=stored.timeout_s, idempotency_key=stored.idempotency_key, signature=stored.signature,
                    id=stored.id)
    action.state = stored.state
    action.submitted_at, action.started_at, action.finished_at = (stored.submitted_at, stored.started_at,
                                                                  stored.finished_at)
    if stored.allocation is not None:
        action.units = dict(stored.allocation.units)
        action.placement = dict(stored.allocation.placement)
        action.resized = None if stored.allocation.malleable is None else stored.allocation.malleable.model_dump(mode="json")
    action.result = stored.result
    action.error = None if stored.error is None else stored.error.model_dump(mode="json")
    action.seq = stored.internal.seq
    action.execution_s = stored.internal.execution_s
    action.restore_s = stored.timings.restore_s
    action.expected_duration_s = stored.internal.expected_duration_s
    return action
