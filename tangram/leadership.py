"""One leader among the brokers that share a PostgreSQL store (issue 17): the others stand by and take over when it
dies.

Leading is holding a session-level advisory lock on a connection of its own. PostgreSQL drops the lock the moment
that session ends, so a leader killed with ``kill -9`` (or whose host dies, once TCP says so) frees it, and a standby
polling for it takes over: it then runs the ordinary start (crash recovery of the queue, adoption of sandboxes
through the node agents). The leader records the URL clients reach it at, so a standby can say where it is. A leader
whose lock connection fails stops at once: another broker may hold the lock by then, and two leaders must never
write one store.

Stopping at once still leaves a window (the lock's connection can fail seconds before its check notices), so the
store is fenced too: each leader takes the next *epoch* in the leader's row as it takes over, and every write
transaction of the store first reads that row ``FOR SHARE`` and is refused (``Deposed``) unless the epoch is still
its own. The row lock orders the two: a new leader's epoch waits for the old one's write in flight to commit, and
every later write of the old one sees the new epoch.

Beyond the store, the leader's ``fencing`` (``tangram/core/fencing.py``) carries the epoch to the node agents,
which refuse an older one, and is deposed by whichever learns first of the loss (the lock's check, the store's
fence, an agent's refusal), so nothing more goes to a sandbox or an upstream either.
"""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection

from tangram.core.fencing import Fencing
from tangram.store.fence import Deposed, Fence

log = logging.getLogger("tangram")

#: the advisory lock's key: one leader per database
LOCK_KEY = int.from_bytes(b"tangram", "big")
#: how often a standby asks for the lock, and a leader checks it still holds it
POLL_S = 0.5
#: a check of the lock's connection that takes longer than this counts as lost
CHECK_TIMEOUT_S = 5.0

LEADER_TABLE = """CREATE TABLE IF NOT EXISTS tangram_leader (
    lock_key BIGINT PRIMARY KEY, url TEXT NOT NULL, since DOUBLE PRECISION NOT NULL)"""
#: the leaders' epochs (a table from before fencing gains the column)
EPOCH_COLUMN = "ALTER TABLE tangram_leader ADD COLUMN IF NOT EXISTS epoch BIGINT NOT NULL DEFAULT 0"
_CURRENT_EPOCH = text("SELECT epoch FROM tangram_leader WHERE lock_key = :key FOR SHARE")


def fence(epoch: int, fencing: Fencing | None = None) -> Fence:
    """The store's fence for the leader of ``epoch``: a write goes through only while no later leader took over.
    A refusal deposes ``fencing`` too, before the write fails."""
    async def check(conn: AsyncConnection) -> None:
        current = (await conn.execute(_CURRENT_EPOCH, {"key": LOCK_KEY})).scalar()
        if current != epoch:
            refusal = Deposed(f"this broker led as epoch {epoch}; another broker leads the store now "
                              f"(epoch {current})")
            if fencing is not None:
                fencing.depose(str(refusal))
            raise refusal
    return check


def asyncpg_dsn(store_url: str) -> str:
    """The store's SQLAlchemy URL (``postgresql+asyncpg://...``) as asyncpg takes it."""
    return make_url(store_url).set(drivername="postgresql").render_as_string(hide_password=False)


class Leadership:
    """This broker's claim to lead, over its own connection to the store's database."""

    def __init__(self, connection: asyncpg.Connection, url: str) -> None:
        self._connection = connection
        self.url = url
        #: where the leader is, as last read while standing by (None: no broker has led yet)
        self.leader_url: str | None = None
        #: this broker's epoch once it leads (each leader's is one more than the one before)
        self.epoch: int | None = None
        #: what the broker sends beyond its store reads (the epoch, once it leads; deposed once the lock is lost)
        self.fencing = Fencing()

    @classmethod
    async def open(cls, store_url: str, url: str) -> Leadership:
        """``url``: where clients reach this broker, told to them by a standby while this one leads."""
        connection = await asyncpg.connect(asyncpg_dsn(store_url))
        await connection.execute(LEADER_TABLE)
        await connection.execute(EPOCH_COLUMN)
        return cls(connection, url)

    async def acquire(self) -> None:
        """Wait until this broker leads (noting where the leader is meanwhile)."""
        while not await self.try_to_lead():
            await asyncio.sleep(POLL_S)

    async def try_to_lead(self) -> bool:
        """Take the lock if no broker holds it: then take the next epoch and record where clients reach this broker
        (True). Otherwise note where the leader is (False)."""
        if not await self._connection.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY):
            self.leader_url = await self._connection.fetchval("SELECT url FROM tangram_leader WHERE lock_key = $1",
                                                              LOCK_KEY)
            return False
        self.leader_url = self.url
        self.epoch = await self._connection.fetchval(
            "INSERT INTO tangram_leader (lock_key, url, since, epoch) VALUES ($1, $2, $3, 1) "
            "ON CONFLICT (lock_key) DO UPDATE SET url = EXCLUDED.url, since = EXCLUDED.since, "
            "epoch = tangram_leader.epoch + 1 RETURNING epoch",
            LOCK_KEY, self.url, time.time())
        self.fencing.epoch = self.epoch
        log.info("leading the brokers of this store as epoch %d; clients reach the leader at %s", self.epoch,
                 self.url)
        return True

    async def lost(self) -> str:
        """Return (with the reason, having deposed ``fencing``) once the lock's connection fails: this broker may no
        longer lead."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await asyncio.wait_for(self._connection.fetchval("SELECT 1"), CHECK_TIMEOUT_S)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
                reason = f"the connection that holds the leader's lock failed ({error!r})"
                self.fencing.depose(reason)
                return reason

    async def close(self) -> None:
        """Let the lock go (a standby takes over now rather than when the connection times out)."""
        try:
            await asyncio.wait_for(self._connection.close(), CHECK_TIMEOUT_S)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
            self._connection.terminate()
