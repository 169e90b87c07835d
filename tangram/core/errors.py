"""Errors that reach clients: each names the offending field and why, so a 4xx is actionable."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the broker refuses, naming the offending field and the reason. It carries no HTTP status: the HTTP
    layer maps each class to one (``tangram.server.http_errors``), so the domain says *what* went wrong, not how HTTP
    spells it. ``extra`` goes into the error body; ``retry_after_s`` says when trying again makes sense."""

    def __init__(self, field: str, reason: str, retry_after_s: float | None = None, **extra: Any) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"field": self.field, "reason": self.reason}
        body.update(self.extra)
        return {"error": body}


class BadRequest(RequestError):
    """Malformed: a field of the wrong type, out of its range, or unknown."""


class TooLarge(RequestError):
    """Over a size limit: too many items, files or bytes in one request."""


class NotFound(RequestError):
    """No such action, environment, service or token."""


class Conflict(RequestError):
    """Refused in the state the object is in (already finished, already has an environment)."""


class UnsupportedMediaType(RequestError):
    """A body in a format the broker does not read: not declared ``application/json``."""


class Unprocessable(RequestError):
    """Well-formed but impossible, e.g. a demand no node could ever satisfy."""


class Unauthorized(RequestError):
    """No token, or one the broker does not know (``invalid``)."""

    def __init__(self, reason: str, *, invalid: bool) -> None:
        super().__init__("authorization", reason)
        self.invalid = invalid


class Forbidden(RequestError):
    """A known token without the scope or the task this request needs."""


class TooMany(RequestError):
    """A limit that clears with time: a task at one of its caps, the broker at its environment limit."""


class Unavailable(RequestError):
    """The broker cannot take this now (draining, queue full, database down, no memory free): retry later."""


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
        #: seconds it spent making the resource ready before it failed (as ``Outcome.restore_s``)
        self.restore_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.details}
