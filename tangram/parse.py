"""Turn a client's JSON action into an ``Action``, or a ``BadRequest`` naming the field and the reason."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, overload

from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.errors import BadRequest
from tangram.core.names import NAME, RESOURCE

#: a unit count as an efficiency key: "8", never "08", " 8", "+8" or "8_0", which int() would also take
COUNT = re.compile(r"^[1-9][0-9]{0,8}\Z")
#: efficiency points one action may declare
MAX_EFFICIENCY_POINTS = 1024
KNOWN_FIELDS = frozenset({"task", "trajectory", "kind", "demand", "elasticity", "spec", "timeout_s",
                          "idempotency_key", "signature"})


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one action may ask for."""

    max_units: int = 1_000_000
    max_resources: int = 16
    max_choices: int = 64
    max_timeout_s: float = 3600.0
    default_timeout_s: float = 600.0


def parse_action(body: Any, limits: Limits = Limits(), where: str = "") -> Action:
    """Validate one action object. ``where`` prefixes field names (e.g. ``actions[3].``) in batch errors."""
    if not isinstance(body, dict):
        raise BadRequest(where.rstrip(".") or "body", "must be a JSON object")
    body = without_nulls(body)
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise BadRequest(where + unknown[0], "unknown field")
    task = parse_name(body.get("task"), where + "task", required=True)
    trajectory = parse_name(body.get("trajectory"), where + "trajectory", required=False)
    kind_raw = body.get("kind")
    try:
        kind = Kind(kind_raw)
    except ValueError:
        raise BadRequest(where + "kind", f"must be one of {[k.value for k in Kind]}, got {kind_raw!r}") from None
    demands = _demands(body.get("demand"), where + "demand", limits)
    elasticity = _elasticity(body.get("elasticity"), where + "elasticity", demands)
    spec = body.get("spec", {})
    if not isinstance(spec, dict):
        raise BadRequest(where + "spec", "must be a JSON object")
    timeout = body.get("timeout_s", limits.default_timeout_s)
    if not _number(timeout) or not 0 < timeout <= limits.max_timeout_s:
        raise BadRequest(where + "timeout_s", f"must be a number in (0, {limits.max_timeout_s}]")
    key = body.get("idempotency_key")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 256 or "\x00" in key):
        raise BadRequest(where + "idempotency_key", "must be a string of 1 to 256 characters, without NUL")
    signature = body.get("signature", "")
    if not isinstance(signature, str) or len(signature) > 256 or "\x00" in signature:
        raise BadRequest(where + "signature", "must be a string of at most 256 characters, without NUL")
    return Action(task=task, kind=kind, demands=demands, spec=spec, trajectory=trajectory,
                  elasticity=elasticity, timeout_s=float(timeout), idempotency_key=key, signature=signature)


def without_nulls(body: dict[str, Any]) -> dict[str, Any]:
    """A field given as null is a field not given, for every field (records show absent ones as null)."""
    return {key: value for key, value in body.items() if value is not None}


def known_fields(body: Any, fields: frozenset[str], what: str, shape: str = "must be a JSON object") -> dict[str, Any]:
    """A request body that must be a JSON object of ``fields`` only (``what`` names its kind in the error), with
    null fields dropped."""
    if not isinstance(body, dict):
        raise BadRequest("body", shape)
    body = without_nulls(body)
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field; {what} take {sorted(fields)}")
    return body


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _units(value: Any, field: str, limits: Limits) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(field, "must be a positive integer number of units")
    if value <= 0:
        raise BadRequest(field, "must be at least 1 unit")
    if value > limits.max_units:
        raise BadRequest(field, f"must be at most {limits.max_units} units")
    return value


@overload
def parse_name(value: Any, field: str, required: Literal[True]) -> str: ...


@overload
def parse_name(value: Any, field: str, required: bool) -> str | None: ...


def parse_name(value: Any, field: str, required: bool) -> str | None:
    """A task, trajectory or other id: validated the same way wherever a client sends one."""
    if value is None:
        if required:
            raise BadRequest(field, "is required")
        return None
    if not isinstance(value, str) or not NAME.match(value):
        raise BadRequest(field, "must be 1-128 characters of letters, digits and ._:-/, starting alphanumeric")
    return value


def _demands(value: Any, field: str, limits: Limits) -> dict[str, Demand]:
    if not isinstance(value, dict) or not value:
        raise BadRequest(field, "must be a non-empty object mapping resource names to units")
    if len(value) > limits.max_resources:
        raise BadRequest(field, f"names at most {limits.max_resources} resources")
    demands: dict[str, Demand] = {}
    for name, spec in value.items():
        where = f"{field}.{name}"
        if not RESOURCE.match(name):
            raise BadRequest(where, "is not a valid resource name")
        demands[name] = _demand(spec, where, limits)
    return demands


def _demand(spec: Any, field: str, limits: Limits) -> Demand:
    if isinstance(spec, dict):
        if set(spec) == {"min", "max"}:
            low = _units(spec["min"], field + ".min", limits)
            high = _units(spec["max"], field + ".max", limits)
            if low > high:
                raise BadRequest(field, f"min ({low}) is greater than max ({high})")
            if high - low + 1 > limits.max_choices:
                raise BadRequest(field, f"a range may span at most {limits.max_choices} unit counts")
            return Demand.range(low, high)
        if set(spec) == {"choices"}:
            choices = spec["choices"]
            if not isinstance(choices, list) or not choices:
                raise BadRequest(field + ".choices", "must be a non-empty list of unit counts")
            if len(choices) > limits.max_choices:
                raise BadRequest(field + ".choices", f"may list at most {limits.max_choices} counts")
            counts = sorted({_units(c, field + ".choices", limits) for c in choices})
            return Demand(tuple(counts))
        raise BadRequest(field, 'must be an integer, {"min": a, "max": b} or {"choices": [...]}')
    return Demand.fixed(_units(spec, field, limits))


def _elasticity(value: Any, field: str, demands: dict[str, Demand]) -> Elasticity | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(field, "must be an object with resource and optional efficiency and t1")
    value = without_nulls(value)
    unknown = sorted(set(value) - {"resource", "efficiency", "t1"})
    if unknown:
        raise BadRequest(f"{field}.{unknown[0]}", "unknown field")
    resource = value.get("resource")
    if not isinstance(resource, str) or resource not in demands:
        raise BadRequest(field + ".resource", "must name a resource in demand")
    t1 = value.get("t1")
    if t1 is not None and (not _number(t1) or t1 <= 0):
        raise BadRequest(field + ".t1", "must be a positive number of seconds")
    raw = value.get("efficiency", {})  # none declared: the broker learns it (``tangram.speedup``)
    if not isinstance(raw, dict) or len(raw) > MAX_EFFICIENCY_POINTS:
        raise BadRequest(field + ".efficiency", f"must be an object mapping at most {MAX_EFFICIENCY_POINTS} unit "
                                                f"counts to E in (0, 1]")
    points: list[tuple[int, float]] = []
    for count, eff in raw.items():
        if not isinstance(count, str) or not COUNT.match(count):
            raise BadRequest(f"{field}.efficiency.{count}", "key must be a unit count: digits, at least 1, no "
                                                            "leading zero")
        if not _number(eff) or not 0 < eff <= 1:
            raise BadRequest(f"{field}.efficiency.{count}", "E(m) must be in (0, 1]")
        points.append((int(count), float(eff)))
    return Elasticity(resource=resource, efficiency=tuple(sorted(points)),
                      t1=None if t1 is None else float(t1))
