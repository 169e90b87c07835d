"""Checks the managers' TOML sections share, so every section words its errors the same way."""

from __future__ import annotations

from typing import Any, TypeVar

from tangram.core.errors import ConfigError

T = TypeVar("T")


def check_table(raw: Any, where: str, known: set[str] | frozenset[str]) -> dict[str, Any]:
    """``raw`` as a table whose keys are all ``known``; the error names the first unknown key."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "must be a table")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; known keys are {sorted(known)}")
    return raw


def positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(where, "must be a positive integer")
    return value


def int_limits(cls: type[T], raw: Any, where: str) -> T:
    """A limits dataclass of positive integers from its table (unset keys keep their defaults)."""
    table = check_table(raw, where, set(cls.__dataclass_fields__))  # type: ignore[attr-defined]
    return cls(**{k: positive_int(v, f"{where}.{k}") for k, v in table.items()})
