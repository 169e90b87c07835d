"""Which write errors the data itself caused: those fail every retry, so the writer drops the row instead."""

from __future__ import annotations

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError


def refused(exc: DBAPIError) -> bool:
    """Whether the database refused the data itself (a constraint, a bad value), so no retry can succeed.

    asyncpg reports most server errors as a generic DBAPIError; its SQLSTATE class tells data (22) and
    integrity (23) errors apart from a server that is down, restarting or overloaded.
    """
    if isinstance(exc, (IntegrityError, DataError)):
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None) or ""
    return sqlstate[:2] in ("22", "23")
