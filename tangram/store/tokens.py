"""API tokens in the store (``tangram token create``, ``POST /v1/admin/tokens``): rare writes, so they are committed
at once in the caller's transaction rather than written behind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from tangram.store.tables import TokenRow


@dataclass(frozen=True, slots=True)
class StoredToken:
    """A token row; ``task`` None is the admin."""

    id: str
    sha256: str
    task: str | None
    note: str
    created_at: float
    revoked_at: float | None = None


async def insert_token(conn: AsyncConnection, token: StoredToken) -> None:
    await conn.execute(insert(TokenRow).values(
        id=token.id, sha256=token.sha256, task=token.task, note=token.note, created_at=token.created_at,
        revoked_at=token.revoked_at))


async def revoke_token(conn: AsyncConnection, token_id: str, at: float) -> StoredToken | None:
    """Mark the token revoked at ``at`` (kept if it already was); None if there is no such token."""
    await conn.execute(update(TokenRow).where(TokenRow.id == token_id, TokenRow.revoked_at.is_(None))
                       .values(revoked_at=at))
    row = (await conn.execute(select(TokenRow).where(TokenRow.id == token_id))).first()
    return None if row is None else _stored_token(row)


async def load_tokens(conn: AsyncConnection) -> list[StoredToken]:
    """Every token, revoked ones included, oldest first."""
    rows = await conn.execute(select(TokenRow).order_by(TokenRow.created_at, TokenRow.id))
    return [_stored_token(row) for row in rows]


def _stored_token(row: Any) -> StoredToken:
    return StoredToken(id=row.id, sha256=row.sha256, task=row.task, note=row.note, created_at=row.created_at,
                       revoked_at=row.revoked_at)
