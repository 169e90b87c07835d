"""A client's JSON action as typed request models (the validator and the OpenAPI schema in one declaration), and
its conversion into an ``Action``. Bounds that the config sets (``[limits]``) are built into the models."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import Discriminator, Field, Tag, TypeAdapter

from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.config_tables import TABLE, NonNegative, Seconds
from tangram.core.errors import BadRequest, Unprocessable
from tangram.core.names import RESOURCE, Name, json_pattern
from tangram.core.schema import NO_NUL, WHOLE, PositiveInteger, Schema, explained, parse, parse_json, tag

#: a unit count as an efficiency key: "8", never "08", " 8", "+8" or "8_0", which int() would also take
COUNT = re.compile(r"^[1-9][0-9]{0,8}\Z")
COUNT_REASON = "key must be a unit count: digits, at least 1, no leading zero"
#: efficiency points one action may declare
MAX_EFFICIENCY_POINTS = 1024
#: a string a client names something by: bounded, no NUL (PostgreSQL text cannot hold one)
Label = Annotated[str, Field(max_length=256, pattern=NO_NUL)]
#: the spellings of a query flag such as ``?wait=`` (Python's str() of a bool included)
FLAGS = {"true": True, "True": True, "1": True, "false": False, "False": False, "0": False}
DEMAND_FORMS = 'must be an integer, {"min": a, "max": b} or {"choices": [...]}'


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one action may ask for (``[limits]``)."""

    __pydantic_config__ = TABLE

    max_units: NonNegative = 1_000_000
    max_resources: NonNegative = 16
    max_choices: NonNegative = 64
    max_timeout_s: Seconds = 3600.0
    default_timeout_s: Seconds = 600.0


class ElasticityBody(Schema):
    """How the key resource speeds the action up; a prior the broker refines from completed runs."""

    resource: str = Field(description="key elasticity resource; must be in demand")
    efficiency: Annotated[dict[Annotated[str, Field(pattern=explained(json_pattern(COUNT), COUNT_REASON))],
                               Annotated[float, Field(gt=0, le=1)]],
                          Field(max_length=MAX_EFFICIENCY_POINTS)] | None = Field(
        default=None, description="E(m) by unit count m; getDur(m) = t1 / (E(m) * m); none: E = 1. A prior: the "
                                  "broker learns the real curve from completed runs")
    t1: Annotated[float, Field(gt=0)] | None = Field(default=None, description="seconds on one unit; learned if "
                                                                               "absent")


def _demand_form(value: Any) -> str | None:
    if isinstance(value, (int, float)):
        return tag("units")
    if isinstance(value, dict):
        return tag("choices") if "choices" in value else tag("range")
    return None


class DemandRange(Schema):
    """Any count from min to max."""

    max_span: ClassVar[int] = Limits().max_choices
    min: PositiveInteger
    max: PositiveInteger = Field(description="at least min; the range spans at most [limits] max_choices unit counts")


class DemandChoices(Schema):
    """One of the listed counts."""

    choices: list[PositiveInteger] = Field(min_length=1)


class ActionBody(Schema):
    """One action as a client submits it; a null field is a field not given. ``action_types`` bounds it."""

    task: Name | None = None
    trajectory: Name | None = None
    kind: Kind = Field(strict=False)
    demand: Mapping[str, PositiveInteger | DemandRange | DemandChoices]
    elasticity: ElasticityBody | None = None
    spec: dict[str, Any] | None = Field(default=None, description="kind-specific; see the kind's spec schema")
    timeout_s: float | None = Field(default=None, description="deadline from submission, queueing included")
    idempotency_key: Annotated[Label, Field(min_length=1)] | None = None
    signature: Label | None = Field(default=None, description="actions sharing (task, signature) share a learned "
                                                              "duration")


class BatchBody(Schema):
    """Many actions, all validated before any is queued."""

    actions: Sequence[ActionBody] = Field(min_length=1)


@functools.cache
def action_types(limits: Limits) -> tuple[TypeAdapter[ActionBody], TypeAdapter[BatchBody]]:
    """The action and batch request types with the config's bounds in them (built once per config)."""
    units = Annotated[int, Field(ge=1, le=limits.max_units), WHOLE]

    class BoundedRange(DemandRange):
        max_span = limits.max_choices
        min: units = Field(title="min")  # type: ignore[valid-type]
        max: units = Field(title="max")  # type: ignore[valid-type]

    class BoundedChoices(DemandChoices):
        choices: list[units] = Field(min_length=1, max_length=limits.max_choices)  # type: ignore[valid-type]

    entry = Annotated[Annotated[units, Tag(tag("units"))]  # type: ignore[valid-type]
                      | Annotated[BoundedRange, Tag(tag("range"))] | Annotated[BoundedChoices, Tag(tag("choices"))],
                      Discriminator(_demand_form, custom_error_type="demand_form", custom_error_message=DEMAND_FORMS)]

    class Action(ActionBody):
        demand: dict[Annotated[str, Field(pattern=explained(json_pattern(RESOURCE), "is not a valid resource name"))],
                     entry] = Field(  # type: ignore[valid-type]
            min_length=1, max_length=limits.max_resources)
        timeout_s: Annotated[float, Field(gt=0, le=limits.max_timeout_s)] | None = Field(
            default=None, description=f"deadline from submission, queueing included; default "
                                      f"{limits.default_timeout_s}")

    class Batch(BatchBody):
        actions: list[Action] = Field(min_length=1)

    return TypeAdapter(Action), TypeAdapter(Batch)


def parse_action(body: Any, limits: Limits = Limits()) -> Action:
    """Validate one decoded action object (the API reads bytes with ``parse_action_json`` instead)."""
    return to_action(parse(action_types(limits)[0], body), limits)


def parse_action_json(raw: bytes, limits: Limits) -> ActionBody:
    """One action straight from the request's bytes, as its typed body (``to_action`` makes the ``Action``)."""
    return parse_json(action_types(limits)[0], raw)


def parse_batch_json(raw: bytes, limits: Limits) -> list[ActionBody]:
    """A batch's typed action bodies, in order."""
    return list(parse_json(action_types(limits)[1], raw).actions)


def to_action(body: ActionBody, limits: Limits, task: str | None = None, where: str = "") -> Action:
    """The ``Action`` a typed body asks for. What spans fields, which the document states but its schema cannot
    check (a range's min <= max, the elasticity resource in demand), is refused as unprocessable (422)."""
    demands = {name: _demand(entry, f"{where}demand.{name}") for name, entry in body.demand.items()}
    elasticity = None
    if body.elasticity is not None:
        declared = body.elasticity
        if declared.resource not in demands:
            raise Unprocessable(where + "elasticity.resource", "must name a resource in demand")
        points = tuple(sorted((int(m), e) for m, e in (declared.efficiency or {}).items()))
        elasticity = Elasticity(resource=declared.resource, efficiency=points, t1=declared.t1)
    owner = body.task or task
    if owner is None:
        raise BadRequest(where + "task", "is required")
    return Action(task=owner, kind=body.kind, demands=demands, spec=body.spec or {}, trajectory=body.trajectory,
                  elasticity=elasticity, timeout_s=limits.default_timeout_s if body.timeout_s is None
                  else body.timeout_s, idempotency_key=body.idempotency_key, signature=body.signature or "")


def _demand(entry: int | DemandRange | DemandChoices, where: str) -> Demand:
    if isinstance(entry, int):
        return Demand.fixed(entry)
    if isinstance(entry, DemandChoices):
        return Demand(tuple(sorted(set(entry.choices))))
    if entry.min > entry.max:
        raise Unprocessable(where, f"min ({entry.min}) is greater than max ({entry.max})")
    if entry.max - entry.min + 1 > entry.max_span:
        raise Unprocessable(where, f"a range may span at most {entry.max_span} unit counts")
    return Demand.range(entry.min, entry.max)
