"""Errors that reach clients: each names the offending field and why, so a 4xx is actionable."""

from __future__ import annotations

from typing import Any


class BadRequest(Exception):
    """A client error: rendered as ``{"error": {"field": ..., "reason": ...}}`` with ``status``."""

    def __init__(self, field: str, reason: str, status: int = 400, **extra: Any) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.status = status
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"field": self.field, "reason": self.reason}
        body.update(self.extra)
        return {"error": body}


class NotFound(BadRequest):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason, status=404)


class Conflict(BadRequest):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason, status=409)


class Unprocessable(BadRequest):
    """Well-formed but impossible, e.g. a demand no node could ever satisfy."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason, status=422)


class ConfigError(Exception):
    """A bad key in the TOML config; the message names the key and the reason."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"config key '{key}': {reason}")
        self.key = key
        self.reason = reason


class ActionFailed(Exception):
    """Raised by a manager's ``execute`` for an expected failure; becomes the action's structured error."""

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.details}
