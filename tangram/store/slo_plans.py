"""SLO plans in the store (``PUT /v1/tasks/NAME/slo``): rare writes, so they are committed at once in the caller's
transaction rather than written behind."""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncConnection

from tangram.store.statements import dialect_of, upsert
from tangram.store.tables import SloPlanRow


async def put_slo_plan(conn: AsyncConnection, task: str, plan: dict[str, Any], at: float) -> None:
    """Keep ``task``'s plan (its fields), replacing the one it had."""
    await conn.execute(upsert(dialect_of(conn.engine), SloPlanRow, ["task"]).values(
        task=task, plan=orjson.dumps(plan).decode(), updated_at=at))


async def delete_slo_plan(conn: AsyncConnection, task: str) -> bool:
    """Forget ``task``'s plan; False if it had none."""
    deleted = await conn.execute(delete(SloPlanRow).where(SloPlanRow.task == task))
    return bool(deleted.rowcount)


async def load_slo_plans(conn: AsyncConnection) -> dict[str, dict[str, Any]]:
    """Every task's plan (its fields), oldest first."""
    rows = await conn.execute(select(SloPlanRow.task, SloPlanRow.plan).order_by(SloPlanRow.updated_at))
    return {task: orjson.loads(plan) for task, plan in rows}
