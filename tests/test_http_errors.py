"""The HTTP layer's one table from domain errors to statuses and headers."""

from __future__ import annotations

import inspect

import pytest

from tangram.core import errors
from tangram.core.errors import (
    BadRequest,
    Conflict,
    NotFound,
    RequestError,
    TooLarge,
    TooMany,
    Unauthorized,
    Unavailable,
    Unprocessable,
)
from tangram.sched.tenants import OverCap
from tangram.server.http_errors import STATUS, headers_of, status_of


def test_every_domain_error_class_has_its_own_row() -> None:
    """A new error class must be given a status, not fall through to the base's 400 unnoticed."""
    classes = {c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, RequestError)}
    assert classes == {kind for kind, _ in STATUS}
    assert all(not hasattr(kind, "status") for kind in classes)  # the domain carries no HTTP status


@pytest.mark.parametrize(("error", "status"), [
    (BadRequest("f", "r"), 400), (NotFound("id", "r"), 404), (Conflict("id", "r"), 409), (TooLarge("b", "r"), 413),
    (Unprocessable("d", "r"), 422), (TooMany("t", "r"), 429), (Unavailable("s", "r"), 503),
    (Unauthorized("r", invalid=False), 401), (errors.Forbidden("task", "r"), 403),
    (OverCap("t", "actions", 3, "r", 7), 429)])
def test_each_class_maps_to_its_status(error: RequestError, status: int) -> None:
    assert status_of(error) == status
    assert error.to_json()["error"]["field"] == error.field


def test_headers_come_from_typed_fields() -> None:
    assert headers_of(BadRequest("f", "r")) is None
    assert headers_of(Unavailable("s", "r", retry_after_s=0.2)) == {"Retry-After": "1"}  # whole seconds, rounded up
    assert headers_of(OverCap("t", "actions", 3, "r", 7)) == {"Retry-After": "7"}
    assert headers_of(Unauthorized("r", invalid=True)) == {
        "WWW-Authenticate": 'Bearer realm="tangram", error="invalid_token"'}
    assert headers_of(Unauthorized("r", invalid=False)) == {"WWW-Authenticate": 'Bearer realm="tangram"'}
    assert OverCap("t", "actions", 3, "r", 7).to_json()["error"] == {"field": "task", "reason": "r",
                                                                       "cap": "actions", "limit": 3}
