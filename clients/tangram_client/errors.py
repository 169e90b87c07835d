"""Typed errors of the Python client. A broker answer's ``{"error": {"field", "reason"}}`` survives as attributes,
so callers branch on the class and show the server's own words."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tangram_client.records import ActionRecord


class TangramError(Exception):
    """Base of everything this client raises."""


class BrokerUnreachable(TangramError):
    """The broker could not be reached (connection refused, reset, timed out) and the retries are spent."""


class ApiError(TangramError):
    """The broker answered with a 4xx or 5xx; ``field`` and ``reason`` are its explanation."""

    def __init__(self, status: int, field: str, reason: str, body: Any = None, attempts: int = 1) -> None:
        super().__init__(f"HTTP {status}: {field}: {reason}")
        self.status = status
        self.field = field
        self.reason = reason
        self.body = body
        self.attempts = attempts  # >1 when earlier attempts were lost or refused with 429/503


class BadRequestError(ApiError):
    """400: a malformed request; ``field`` names the offending part."""


class UnauthorizedError(ApiError):
    """401: no token, or one the broker does not know (or revoked)."""


class ForbiddenError(ApiError):
    """403: the token is valid but not for this (another task's name, an admin route)."""


class NotFoundError(ApiError):
    """404: no such action, lease or environment."""


class ConflictError(ApiError):
    """409: the object is in a state that forbids the operation (cancelling a finished action, a lost sandbox)."""


class TooLargeError(ApiError):
    """413: a body or batch over the broker's limits."""


class UnprocessableError(ApiError):
    """422: well-formed but impossible here (a demand no node could ever satisfy, a kind no manager runs)."""


class OverloadedError(ApiError):
    """429 or 503: the broker asks to come back later; raised once the retries are spent."""


_BY_STATUS: dict[int, type[ApiError]] = {400: BadRequestError, 401: UnauthorizedError, 403: ForbiddenError,
                                         404: NotFoundError, 409: ConflictError,
                                         413: TooLargeError, 422: UnprocessableError, 429: OverloadedError,
                                         503: OverloadedError}


def api_error(status: int, body: Any, attempts: int = 1) -> ApiError:
    """The typed error for a broker answer, keeping its field and reason (or the raw body if it is not ours)."""
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, dict):
        field, reason = str(detail.get("field", "")), str(detail.get("reason", ""))
    else:
        field, reason = "response", str(body)[:500]
    return _BY_STATUS.get(status, ApiError)(status, field, reason, body, attempts)


class ActionError(TangramError):
    """An action ended in a state other than ``succeeded``; ``code`` and ``message`` come from its error record."""

    def __init__(self, record: ActionRecord) -> None:
        error = record.error or {}
        self.record = record
        self.code = str(error.get("code", record.state))
        self.message = str(error.get("message", f"action ended {record.state}"))
        super().__init__(f"action {record.id} {record.state}: {self.code}: {self.message}")


def config_error(error: BaseException) -> bool:
    """Whether the broker refused a call for the caller's setup rather than for its command: a token missing,
    unknown or not for this task (401, 403), or a spec field other than the command it cannot accept (422). A tool or
    an adapter raises these rather than showing them to a model: every later call would fail alike."""
    if isinstance(error, (UnauthorizedError, ForbiddenError)):
        return True
    return isinstance(error, UnprocessableError) and error.field != "spec.command"


class WaitTimeout(TangramError):
    """``wait`` ran out of the caller's time before the action ended; ``record`` is its last known state."""

    def __init__(self, record: ActionRecord) -> None:
        super().__init__(f"action {record.id} still {record.state} when the wait ended")
        self.record = record
