"""TOML config tables read into the config's own frozen dataclasses, validated by pydantic from their annotations.

A config dataclass declares its keys, defaults and bounds once (``depth: Count = 2``); ``table`` reads a TOML table
into it and turns the first failure into a ``ConfigError`` naming the key as the file spells it
(``cpu.nodes.n1.cores``). Types are strict: ``"80"`` is not a port and ``1`` is not ``true``; an integer is a number.
Each dataclass sets ``__pydantic_config__ = TABLE`` so that an unknown key is refused, not ignored.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import (
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)

from tangram.core.errors import ConfigError
from tangram.core.schema import REASONS, first_failure

T = TypeVar("T")

#: every config dataclass's pydantic settings: unknown keys refused, no NaN or infinity
TABLE = ConfigDict(extra="forbid", allow_inf_nan=False)

Count = Annotated[StrictInt, Field(ge=1)]
NonNegative = Annotated[StrictInt, Field(ge=0)]
Number = Annotated[float, Strict()]
Seconds = Annotated[float, Strict(), Field(ge=0)]
PositiveSeconds = Annotated[float, Strict(), Field(gt=0)]
Flag = StrictBool
Text = Annotated[StrictStr, Field(min_length=1)]


def _auto_flag(value: Any) -> bool | None:
    if isinstance(value, bool) or value is None:
        return value
    if value == "auto":
        return None
    raise ValueError('must be true, false or "auto"')


#: true, false or "auto" (None: decided from what the broker finds)
AutoFlag = Annotated[bool | None, PlainValidator(_auto_flag)]

#: reasons in the config's words (TOML has tables, not JSON objects)
CONFIG_REASONS = {**REASONS, "dict_type": "must be a table", "dataclass_type": "must be a table",
                  "unexpected_keyword_argument": "unknown key", "missing_argument": "is required",
                  "int_type": "must be an integer", "float_type": "must be a number",
                  "bool_type": "must be true or false", "string_type": "must be a string",
                  "tuple_type": "must be a list", "list_type": "must be a list",
                  "literal_error": "must be one of {expected}", "finite_number": "must be a finite number"}


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(kind: Any) -> TypeAdapter[Any]:
    if kind not in _ADAPTERS:
        _ADAPTERS[kind] = TypeAdapter(kind)
    return _ADAPTERS[kind]


def table(kind: type[T], raw: Any, where: str) -> T:
    """``raw`` (a TOML table) as the dataclass ``kind``, or the ``ConfigError`` naming the first bad key."""
    try:
        return _adapter(kind).validate_python(raw)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        key, reason = first_failure(error, where, CONFIG_REASONS)
        if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            known = _keys_at(kind, tuple(first["loc"])[:-1])
            reason += f"; known keys are {known}" if known else ""
        raise ConfigError(key, reason) from None


def named_tables(kind: type[T], raw: Any, where: str) -> tuple[T, ...]:
    """``[where.NAME]`` tables as ``kind`` values whose ``name`` is the table's name, in the file's order."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "must be a table of named tables")
    values = []
    for name, body in raw.items():
        if isinstance(body, dict) and "name" in body:
            raise ConfigError(f"{where}.{name}.name", "unknown key; the table's name is its name")
        values.append(table(kind, {**body, "name": name} if isinstance(body, dict) else body, f"{where}.{name}"))
    return tuple(values)


def _keys_at(kind: Any, location: tuple[Any, ...]) -> list[str]:
    """The keys the table at ``location`` inside ``kind`` knows, for the error on an unknown one."""
    for part in location:
        kind = _unwrap(kind)
        if dataclasses.is_dataclass(kind) and isinstance(part, str):
            kind = typing.get_type_hints(kind, include_extras=True).get(part)
        elif typing.get_origin(kind) in (dict, Mapping):
            kind = typing.get_args(kind)[1]
        elif typing.get_origin(kind) is tuple:
            kind = typing.get_args(kind)[0]
    kind = _unwrap(kind)
    return sorted(f.name for f in dataclasses.fields(kind) if f.name != "name") if dataclasses.is_dataclass(kind) \
        else []


def _unwrap(kind: Any) -> Any:
    """The dataclass or container under ``Annotated[...]`` and ``X | None``."""
    while typing.get_origin(kind) is Annotated or (typing.get_args(kind) and type(None) in typing.get_args(kind)):
        kind = typing.get_args(kind)[0]
    return kind
