"""The broker's tables: action records, their state transitions, learned duration profiles, the runs of learned
speed-up models, API tokens and SLO plans. Other persistent state can declare its tables on ``Base`` too."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Double, Index, Integer, String, Text, TextClause, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tangram.core.action import Kind, State

# 64-bit ids and counters (a busy broker passes 2**31 transitions in days); SQLite autoincrements INTEGER only.
_BIG = BigInteger().with_variant(Integer, "sqlite")


# Each index on ``actions`` holds only the rows its one query reads: most actions end as soon as they start, and an
# index a row never enters costs its write nothing. Its condition is SQL text, and the query's WHERE repeats it word
# for word where the query does not imply it: SQLite uses a partial index only for a query that states its terms,
# literals and all (a bound parameter does not count).
#: the actions a restart resumes (``Store.load_unfinished``)
UNFINISHED = text(f"state IN ('{State.QUEUED}', '{State.RUNNING}')")
#: the leases a restart looks for (``Store.load_granted_leases``)
LEASES = text(f"kind = '{Kind.LEASE}'")
#: the actions submitted under an idempotency key: NULL keys never collide, so the others need no entry (a lookup by
#: key, ``key_lookups.py``, implies it on both databases)
KEYED = text("idempotency_key IS NOT NULL")
#: indexes of older versions that those above replace: dropped from an older database at open
SUPERSEDED_INDEXES = {"actions": ("ix_actions_state", "ix_actions_kind_state_finished_at")}


def _partial(where: TextClause) -> dict[str, Any]:
    """An index's condition for both databases."""
    return {"sqlite_where": where, "postgresql_where": where}


class Base(DeclarativeBase):
    """Metadata of the broker's tables; other persistent state can declare its tables on it too."""


class ActionRow(Base):
    __tablename__ = "actions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    seq: Mapped[int] = mapped_column(_BIG)
    task: Mapped[str] = mapped_column(String)
    trajectory: Mapped[str | None] = mapped_column(String)
    kind: Mapped[str] = mapped_column(String)
    state: Mapped[str] = mapped_column(String)
    idempotency_key: Mapped[str | None] = mapped_column(String)
    signature: Mapped[str] = mapped_column(String)
    submitted_at: Mapped[float] = mapped_column(Double)
    started_at: Mapped[float | None] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double)
    record: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("uq_actions_task_idempotency_key", "task", "idempotency_key", unique=True,
                            **_partial(KEYED)),
                      Index("ix_actions_unfinished", "seq", **_partial(UNFINISHED)),
                      Index("ix_actions_leases", "state", "finished_at", **_partial(LEASES)))


class TransitionRow(Base):
    __tablename__ = "transitions"

    id: Mapped[int] = mapped_column(_BIG, primary_key=True, autoincrement=True)
    action_id: Mapped[str] = mapped_column(String)
    state: Mapped[str] = mapped_column(String)
    at: Mapped[float] = mapped_column(Double)

    __table_args__ = (Index("ix_transitions_action_id", "action_id", "id"),)


class ProfileRow(Base):
    __tablename__ = "profiles"

    task: Mapped[str] = mapped_column(String, primary_key=True)
    signature: Mapped[str] = mapped_column(String, primary_key=True)
    t1: Mapped[float] = mapped_column(Double)
    samples: Mapped[int] = mapped_column(_BIG)


class SpeedupRow(Base):
    """The runs a (task, signature)'s speed-up model is fitted to (``tangram.sched.speedup``), as a JSON list."""

    __tablename__ = "speedups"

    task: Mapped[str] = mapped_column(String, primary_key=True)
    signature: Mapped[str] = mapped_column(String, primary_key=True)
    runs: Mapped[str] = mapped_column(Text)


class TokenRow(Base):
    """An API token made by ``tangram token create`` or ``POST /v1/admin/tokens``: only its SHA-256 is kept."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    task: Mapped[str | None] = mapped_column(String)  # None: an admin token
    note: Mapped[str] = mapped_column(String)
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double)


class SloPlanRow(Base):
    """A task's SLO plan made by ``PUT /v1/tasks/NAME/slo`` (``tangram.slo.plan.SloPlan``'s fields as JSON)."""

    __tablename__ = "slo_plans"

    task: Mapped[str] = mapped_column(String, primary_key=True)
    plan: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[float] = mapped_column(Double)
