"""The store the broker holds: its writes go behind (``group_commit``), and its reads see every earlier ``save``."""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tangram.core.action import Action, State
from tangram.records import action_from_stored, stored_record
from tangram.store import slo_plans, tokens
from tangram.store.engine import open_engine
from tangram.store.fence import Fence
from tangram.store.group_commit import GroupCommitWriter
from tangram.store.key_lookups import KeyLookups
from tangram.store.tables import LEASES, UNFINISHED, ActionRow, ProfileRow, SpeedupRow, TransitionRow
from tangram.store.tokens import StoredToken

# Built once: constructing a statement costs more than running it on the submit path.
_GET = select(ActionRow.record).where(ActionRow.id == bindparam("id"))


def _snapshot(action: Action) -> Action:
    """A copy of an action whose record is not committed yet, as a database read would return it."""
    return action_from_stored(stored_record(action))


class Store(GroupCommitWriter):
    """Persistence of actions, transitions, duration profiles, speed-up runs, API tokens and SLO plans.

    Reads see every earlier ``save``: ``get`` and ``find_by_idempotency`` look at the records not yet committed
    first (they are on the submit path and must not wait for a write), the other reads flush first. Concurrent
    idempotency lookups share one query, as concurrent ``durable`` calls share one transaction. Tokens and SLO plans
    are rare writes, committed at once (not written behind), fenced like the others.
    """

    def __init__(self, engine: AsyncEngine, *, write_delay_s: float = 0.02, max_attempts: int = 3,
                 backoff_s: float = 0.1, max_backoff_s: float = 2.0, fence: Fence | None = None) -> None:
        super().__init__(engine, write_delay_s=write_delay_s, max_attempts=max_attempts, backoff_s=backoff_s,
                         max_backoff_s=max_backoff_s, fence=fence)
        self._key_lookups = KeyLookups(engine)

    @classmethod
    async def open(cls, url: str, **settings: Any) -> Store:
        """Create the engine and the tables; ``settings`` are the constructor's keyword arguments."""
        return cls(await open_engine(url), **settings)

    async def close(self) -> None:
        """Write everything pending, stop the flusher and release the connections."""
        if self._closed:
            return
        try:
            await super().close()
        finally:
            await self._key_lookups.close()
            await self.engine.dispose()

    # -- actions ------------------------------------------------------------------------------------------------

    async def get(self, action_id: str) -> Action | None:
        unwritten = self._unwritten(action_id)
        if unwritten is not None:
            return _snapshot(unwritten)
        async with self.engine.connect() as conn:
            record = await conn.scalar(_GET, {"id": action_id})
        return None if record is None else self._loaded(record)

    async def find_by_idempotency(self, task: str, key: str) -> Action | None:
        return (await self.find_many_by_idempotency([(task, key)])).get((task, key))

    async def find_many_by_idempotency(self, idents: list[tuple[str, str]]) -> dict[tuple[str, str], Action]:
        """The actions already submitted under these (task, idempotency key) pairs; absent pairs are new.

        One query answers a whole batch submit, and concurrent callers' lookups are merged into it.
        """
        found: dict[tuple[str, str], Action] = {}
        wanted: list[tuple[str, str]] = []
        for ident in idents:
            unwritten = self._unwritten_by_key(ident)
            if unwritten is None:
                wanted.append(ident)
            else:
                found[ident] = _snapshot(unwritten)
        if wanted:
            for ident, record in (await self._key_lookups.find(wanted)).items():
                found[ident] = self._loaded(record)
        return found

    async def load_unfinished(self) -> list[Action]:
        """Queued and running actions in submission order, to resume after a restart."""
        return await self._load(select(ActionRow.record).where(UNFINISHED).order_by(ActionRow.seq))

    async def load_granted_leases(self, since: float) -> list[Action]:
        """Lease actions granted (succeeded) at ``since`` or later, returned or not: the caller reads their result."""
        return await self._load(select(ActionRow.record).where(
            LEASES, ActionRow.state == State.SUCCEEDED.value, ActionRow.finished_at >= since)
            .order_by(ActionRow.seq))

    async def max_seq(self) -> int:
        await self.flush()
        async with self.engine.connect() as conn:
            return (await conn.scalar(select(func.max(ActionRow.seq)))) or 0

    async def transitions(self, action_id: str) -> list[tuple[str, float]]:
        await self.flush()
        query = (select(TransitionRow.state, TransitionRow.at).where(TransitionRow.action_id == action_id)
                 .order_by(TransitionRow.id))
        async with self.engine.connect() as conn:
            return [(state, at) for state, at in await conn.execute(query)]

    async def _load(self, query: Any) -> list[Action]:
        await self.flush()
        async with self.engine.connect() as conn:
            records = (await conn.scalars(query)).all()
        return [self._loaded(record) for record in records]

    def _loaded(self, record: str) -> Action:
        """Rebuild a stored action and remember its state, so saving it unchanged appends no transition."""
        action = action_from_stored(record)
        self._remember_loaded(action)
        return action

    # -- what the models learned ----------------------------------------------------------------------------------

    async def load_profiles(self) -> list[tuple[str, str, float, int]]:
        await self.flush()
        query = select(ProfileRow.task, ProfileRow.signature, ProfileRow.t1, ProfileRow.samples)
        async with self.engine.connect() as conn:
            return [(task, signature, t1, samples) for task, signature, t1, samples in await conn.execute(query)]

    async def load_speedups(self) -> list[tuple[str, str, list[list[float]]]]:
        await self.flush()
        query = select(SpeedupRow.task, SpeedupRow.signature, SpeedupRow.runs)
        async with self.engine.connect() as conn:
            return [(task, signature, orjson.loads(runs)) for task, signature, runs in await conn.execute(query)]

    # -- tokens ---------------------------------------------------------------------------------------------------

    async def add_token(self, token: StoredToken) -> None:
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            await tokens.insert_token(conn, token)

    async def revoke_token(self, token_id: str, at: float) -> StoredToken | None:
        """Mark the token revoked at ``at`` (kept if it already was); None if there is no such token."""
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            return await tokens.revoke_token(conn, token_id, at)

    async def load_tokens(self) -> list[StoredToken]:
        """Every token, revoked ones included, oldest first."""
        async with self.engine.connect() as conn:
            return await tokens.load_tokens(conn)

    # -- SLO plans ------------------------------------------------------------------------------------------------

    async def put_slo_plan(self, task: str, plan: dict[str, Any], at: float) -> None:
        """Keep ``task``'s plan (its fields), replacing the one it had."""
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            await slo_plans.put_slo_plan(conn, task, plan, at)

    async def delete_slo_plan(self, task: str) -> bool:
        """Forget ``task``'s plan; False if it had none."""
        async with self.engine.begin() as conn:
            await self._fenced(conn)
            return await slo_plans.delete_slo_plan(conn, task)

    async def load_slo_plans(self) -> dict[str, dict[str, Any]]:
        """Every task's plan (its fields), oldest first."""
        async with self.engine.connect() as conn:
            return await slo_plans.load_slo_plans(conn)
