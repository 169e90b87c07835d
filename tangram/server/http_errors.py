"""How the HTTP layer spells the domain's errors: one table from error class to status, and the headers a class's
typed fields call for (``Retry-After``, ``WWW-Authenticate``)."""

from __future__ import annotations

import math

from tangram.core.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    RequestError,
    TooLarge,
    TooMany,
    Unauthorized,
    Unavailable,
    Unprocessable,
    UnsupportedMediaType,
)

#: the most specific class first; ``RequestError`` itself is a plain 400
STATUS: tuple[tuple[type[RequestError], int], ...] = (
    (BadRequest, 400), (Unauthorized, 401), (Forbidden, 403), (NotFound, 404), (Conflict, 409), (TooLarge, 413),
    (UnsupportedMediaType, 415), (Unprocessable, 422), (TooMany, 429), (Unavailable, 503), (RequestError, 400))


def status_of(error: RequestError) -> int:
    return next(status for kind, status in STATUS if isinstance(error, kind))


def headers_of(error: RequestError) -> dict[str, str] | None:
    """``Retry-After`` in whole seconds (RFC 9110 10.2.3) where the error says when to retry, and the Bearer
    challenge (RFC 6750) on a 401."""
    headers: dict[str, str] = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(0, math.ceil(error.retry_after_s)))
    if isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="tangram"' + (', error="invalid_token"' if error.invalid else "")
    return headers or None
