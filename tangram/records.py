"""What the broker answers and stores, as typed models: the OpenAPI document's response schemas are generated from
them, the tests check the records the broker really sends (and the client reads) against them, and the store reads
its records back through them (``StoredAction``, the store's codec), so the four cannot drift."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import ConfigDict, Field, TypeAdapter

from managers.cpu.environment import EnvState
from managers.cpu.exec_spec import NetworkBody
from reward_services.backend import Task
from tangram.core.action import Action, Demand, Elasticity, Kind, State
from tangram.core.schema import Schema
from tangram.slo.plan import SloPlan


class MalleableSummary(Schema):
    """An elastic action whose units changed as it ran."""

    resource: str
    floor: int
    workers: int = Field(description="the most units it can use: the workers it started with, or its cap where "
                                     "its workers follow its units")
    workers_follow_units: bool = Field(False, description="its workers follow its units (the elastic pytest "
                                                          "runner forks one for each core added)")
    assumed: bool = Field(False, description="nothing was known of its duration when it started (no t1, no run of "
                                             "its signature): it took only the units no estimated action gained "
                                             "from")
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



class EnvironmentRecord(Schema):
    """A trajectory environment (``Environment.to_json``)."""

    id: str
    task: str
    trajectory: str | None
    node: str
    image: str
    memory_mb: int
    sandbox_user: str | None = Field(description='who runs in it: "UID:GID" or "root" (null: taken over after a '
                                                 'restart, not known)')
    network: NetworkBody = Field(description='its sandbox\'s network: {"mode": "none"}, or {"mode": "proxy", "allow": '
                                             '[...]} for an HTTP(S) proxy to those hosts')
    state: EnvState
    created_at: float
    last_used: float
    running_actions: int
    lost_reason: str | None
    sandbox: dict[str, Any] | None = Field(description="the backend's description: container, engine, cores")


class ServicePlacement(Schema):
    """One service's part of the GPU manager's placement (``managers/gpu/live_placement.py``)."""

    load: float = Field(description="its measured demand, GPU-seconds per second on the reference GPU type")
    types: dict[str, float] = Field(description="GPU type -> GPUs' worth of that type's time the placement gives it")
    confined: bool = Field(description="its actions start only on nodes of those types (false: on every node, "
                                       "as for a service without load)")


class ServicePlacementRow(ServicePlacement):
    service: str


class Placement(Schema):
    """The placement of reward services over GPU types in force (``GET /v1/resources``)."""

    method: Literal["ilp", "greedy"] = Field(description="[gpu.placement] method, resolved")
    solves: dict[str, int] = Field(description="solves so far, by the method that gave the answer")
    answered_by: Literal["ilp", "greedy"] | None = Field(description="the last solve's method (greedy when the ILP "
                                                                     "fell back); null before the first")
    objective: float | None = Field(description="t: the factor by which every measured load is served")
    solve_s: float | None
    fallback: str | None = Field(description="why the ILP's answer was not taken")
    services: list[ServicePlacementRow]


class ServiceRecord(Schema):
    """A reward service the GPU manager hosts and where it is resident (``GpuManager.describe_services``)."""

    name: str
    state: str = Field(description='"serving"; for a service added at runtime (``POST /v1/admin/reload``), '
                                   '"preparing" until every instance is prepared, or "failed: ..." with the reason')
    backend: Literal["torch", "sglang"]
    model: str
    task: Task
    dops: list[Literal[1, 2, 4, 8]]
    gpu_memory_mb: int
    host_memory_mb: int
    nodes: list[str]
    instances: int
    host_copies: dict[str, Literal["disk", "loading", "host"]] = Field(
        description="per node with a disk tier: where the service's host copy is (``managers/gpu/host_tier.py``)")
    resident: list[dict[str, Any]]
    run_gpu_s: dict[str, float] = Field(description="GPU type -> GPU-seconds one action ran there lately (an EWMA "
                                                    "of its execution less its restore, times its GPUs)")
    placement: ServicePlacement | None = Field(
        default=None, description="its part of the placement in force; absent when the manager solves none")


Share = Annotated[float, Field(ge=0, le=1)]


class StatusSample(Schema):
    """One sampling interval of the status page (``tangram.server.history.Sample.to_json``)."""

    t: float = Field(description="seconds since the epoch; covers (previous t, t]")
    utilization: dict[str, Share] = Field(description="in use / capacity per resource, summed over its pools")
    queued: dict[str, int] = Field(description="queued actions demanding each resource")
    queued_total: int
    running: int
    leases: int
    finished: int = Field(description="actions that ended during the interval")
    act_p50_s: float | None = Field(description="ACT p50 of the actions that ended during the interval")
    act_p90_s: float | None = Field(description="ACT p90 of the actions that ended during the interval")
    act_p99_s: float | None = Field(description="ACT p99 of the actions that ended during the interval")


class StatusHistory(Schema):
    interval_s: float
    keep_s: float
    samples: list[StatusSample] = Field(description="oldest first")


class ResourceRow(Schema):
    """One pool of one resource; its manager may add details (node, cores, NUMA layout, GPUs)."""

    model_config = ConfigDict(extra="allow")

    resource: str
    pool: str
    manager: str
    capacity: int
    in_use: int
    queued: int


class BrokerStats(Schema):
    queued: int
    running: int
    leases: int
    recent: int = Field(description="recent actions the ACT percentiles cover")
    act_p50_s: float | None
    act_p90_s: float | None
    act_p99_s: float | None


class SloAttainmentRecord(Schema):
    """A planned task's measured attainment (``tangram/slo/attainment.py``): each reward phase that ended is a
    window, within SLO when the step it slowed stayed within the task's slowdown."""

    windows: int
    within: int
    attainment: float | None = Field(description="within / windows; null before the first window")
    last_slowdown: float | None = Field(description="the last window's step slowdown; null before the first "
                                                    "window, or unbounded")


class TaskSlo(SloAttainmentRecord):
    task: str
    slo: float = Field(description="the step slowdown the task tolerates against a dedicated deployment")
    predicted_slowdown: float | None = Field(description="planned on worst-case durations with every planned task "
                                                         "in the pool; null: unbounded (the pool is overloaded)")
    reserved_gpus: int = Field(description="GPUs reserved for the task: its actions go ahead of others' while it "
                                           "holds fewer (0: the shared pool's bound holds it)")


class Resources(Schema):
    resources: list[ResourceRow]
    stats: BrokerStats
    slo: list[TaskSlo] = Field(description="the tasks with an SLO plan (GET /v1/tasks/slo has their plans)")
    placement: Placement | None = Field(description="the GPU manager's placement of services over GPU types; null "
                                                    "when it solves none ([gpu.placement] method)")


class SloPrediction(Schema):
    phase_s: float | None = Field(description="the bound on the task's reward phase in the pool; null: unbounded")
    solo_phase_s: float = Field(description="its reward phase on the dedicated deployment, at its worst")
    slowdown: float | None = Field(description="predicted step slowdown; null: unbounded")
    slo: float
    within: bool
    reserved_gpus: int = Field(description="the GPUs this prediction reserves for the task (0: none needed, the "
                                           "shared bound holds)")


class PlannedTask(Schema):
    task: str
    source: Literal["config", "store"] = Field(description="[tasks.NAME.slo], or PUT /v1/tasks/NAME/slo")
    plan: SloPlan
    prediction: SloPrediction
    reserved_gpus: int = Field(description="the GPUs reserved in force, set when the plans or the config last "
                                           "changed (the prediction's may differ as restore times are learned)")
    attainment: SloAttainmentRecord


class SloPool(Schema):
    gpus: int
    restore_s: dict[str, float] = Field(description="each service's expected restore now")


class SloPlans(Schema):
    """Every task with an SLO plan in force (``tangram/slo/admission.py``)."""

    pool: SloPool | None = Field(description="null: this broker has no GPU manager")
    tasks: list[PlannedTask]
    shelved: dict[str, str] = Field(description="plans in the store not in force since the start, and why")


class UnitsRuns(Schema):
    units: float
    workers: int
    runs: int
    median_s: float


class LearnedSpeedup(Schema):
    """The speed-up model of an elastic signature: T(m, W) = t1 * (serial_s + [W > 1] * (harness_s + per_worker_s *
    W / min(m, W))) + scale * P(m), P(m) = t1 / (E(m) m) as declared (t1 1 s, E 1 if not: the terms are then
    seconds); trusted up to trusted_units, fitted to the recent runs in by_units."""

    runs: int
    serial_s: float
    scale: float
    per_worker_s: float
    harness_s: float
    trusted_units: float
    by_units: list[UnitsRuns]


class Profile(Schema):
    task: str
    signature: str
    t1_s: float = Field(description="learned single-unit duration")
    samples: int
    speedup: LearnedSpeedup | None = Field(description="null before the signature's first elastic run")


class Profiles(Schema):
    profiles: list[Profile]
    total: int = Field(description="profiles that match, beyond the limit too")


class TokenRecord(Schema):
    """A token as listed: never its secret or hash."""

    id: str
    task: str | None
    admin: bool
    source: Literal["config", "store"]
    note: str
    created_at: float | None
    revoked_at: float | None


class CreatedToken(TokenRecord):
    token: str = Field(description="shown only here")


class Drained(Schema):
    draining: bool
    running: int = Field(description="still running at the bound")
    queued: int = Field(description="kept for the next start")


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
