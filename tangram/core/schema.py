"""The base of every typed request body, and the one translation of a schema failure into a ``BadRequest``.

Request types are pydantic models: one declaration is the validator, the OpenAPI schema and the parsed value.
They are strict (``true`` is not a count, ``"1"`` is not a number), refuse unknown fields and non-finite numbers,
and report the first failure as the field path a client sent (``actions[3].demand.cpu.min``).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from tangram.core.errors import BadRequest

T = TypeVar("T")

#: what a union's member tags look like in an error's location; resource and field names never have parentheses
TAG_OPEN = "("

#: reasons in the broker's own words, by pydantic error type; ``{...}`` takes the error's context (its bound)
REASONS = {"missing": "is required", "extra_forbidden": "unknown field", "model_type": "must be a JSON object",
           "dict_type": "must be a JSON object", "model_attributes_type": "must be a JSON object",
           "greater_than_equal": "must be at least {ge}", "less_than_equal": "must be at most {le}",
           "greater_than": "must be greater than {gt}", "less_than": "must be less than {lt}",
           "too_short": "must have at least {min_length} entries", "too_long": "must have at most {max_length} "
                                                                              "entries",
           "string_too_short": "must have at least {min_length} characters",
           "string_too_long": "must have at most {max_length} characters"}


#: plain words for a pattern a client's string failed, by the pattern (``explained`` registers them)
PATTERN_REASONS: dict[str, str] = {}


def explained(pattern: str, reason: str) -> str:
    """``pattern``, registered so that a string failing it is refused with ``reason`` rather than the regex."""
    PATTERN_REASONS[pattern] = reason
    return pattern


#: a string a client sends that PostgreSQL text, a header or a process argument could not hold
NO_NUL = explained("^[^\x00]*$", "must not contain NUL")


def _whole(value: Any) -> Any:
    """JSON Schema's integer is a whole number however written: ``3.0`` is one; ``3.5`` and ``true`` are not."""
    return int(value) if type(value) is float and value.is_integer() else value


#: an integer field of a request, as the document's ``"type": "integer"`` means it; bounds go before ``WHOLE`` in
#: the ``Annotated`` so that the document shows them as its minimum and maximum
WHOLE = BeforeValidator(_whole)
Integer = Annotated[int, WHOLE]
PositiveInteger = Annotated[int, Field(ge=1), WHOLE]
NonNegativeInteger = Annotated[int, Field(ge=0), WHOLE]


class RequestJsonSchema(GenerateJsonSchema):
    """The JSON Schema of our models as their validators read them: a map whose keys have a pattern takes no other
    keys (pydantic leaves ``additionalProperties`` open beside ``patternProperties``)."""

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        json_schema = super().dict_schema(schema)
        if "patternProperties" in json_schema:
            json_schema["additionalProperties"] = False
        return json_schema


class Schema(BaseModel):
    """A request body: strict, closed, finite, immutable once parsed."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


def tag(name: str) -> str:
    """A union member's tag, recognisable in an error location (and skipped when naming the field)."""
    return f"{TAG_OPEN}{name})"


def field_path(location: tuple[int | str, ...], prefix: str = "") -> str:
    """``("actions", 3, "demand", "cpu", "(range)", "min")`` -> ``actions[3].demand.cpu.min``."""
    path = prefix.rstrip(".")
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]" or part.startswith(TAG_OPEN):
            continue
        else:
            path = f"{path}.{part}" if path else part
    return path or "body"


def first_failure(error: ValidationError, prefix: str = "", reasons: dict[str, str] = REASONS) -> tuple[str, str]:
    """(field path, reason) of the first failure, the reason from ``reasons`` by error type where it has one."""
    first = error.errors(include_url=False)[0]
    kind = first["type"]
    if kind == "json_invalid":
        return prefix.rstrip(".") or "body", f"is not valid JSON: {first['msg']}"
    if kind == "string_pattern_mismatch" and first["ctx"]["pattern"] in PATTERN_REASONS:
        return field_path(tuple(first["loc"]), prefix), PATTERN_REASONS[first["ctx"]["pattern"]]
    template = reasons.get(kind)
    reason = template.format(**first.get("ctx", {})) if template else str(first["msg"]).removeprefix("Value error, ")
    return field_path(tuple(first["loc"]), prefix), reason


def request_error(error: ValidationError, prefix: str = "") -> BadRequest:
    """The first failure, named by its field path (``prefix`` names where the validated value sits)."""
    return BadRequest(*first_failure(error, prefix))


def parse(adapter: TypeAdapter[T], value: Any, prefix: str = "") -> T:
    """``value`` (decoded JSON) as the adapter's type, or the ``BadRequest`` naming the first bad field."""
    try:
        return adapter.validate_python(value)
    except ValidationError as error:
        raise request_error(error, prefix) from None


def parse_json(adapter: TypeAdapter[T], raw: bytes, prefix: str = "") -> T:
    """Raw JSON bytes straight into the adapter's type (one pass, no intermediate dicts)."""
    try:
        return adapter.validate_json(raw)
    except ValidationError as error:
        raise request_error(error, prefix) from None
