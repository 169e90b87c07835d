"""The broker's tables: action records, their state transitions, learned duration profiles, the runs of learned
speed-up models, API tokens and SLO plans. Other persistent state can declare its tables on ``Base`` too."""

from __future__ import annotations

from sqlalchemy import BigInteger, Double, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# 64-bit ids and counters (a busy broker passes 2**31 transitions in days); SQLite autoincrements INTEGER only.
_BIG = BigInteger().with_variant(Integer, "sqlite")


class Base(DeclarativeBase):
    """Metadata of the broker's tables; other persistent state can declare its tables on it too."""


class ActionRow(Base):
    __tablename__ = "actions"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    seq: Mapped[int] = mapped_column(_BIG)
    task: Mapped[str] = mapped_column(String)
    trajectory: Mapped[str | None] = mapped_column(String)
    kind: Mapped[str] = mapped_column(String)
    state: Mapped[str] = mapped_column(String, index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String)
    signature: Mapped[str] = mapped_column(String)
    submitted_at: Mapped[float] = mapped_column(Double)
    started_at: Mapped[float | None] = mapped_column(Double)
    finished_at: Mapped[float | None] = mapped_column(Double)
    record: Mapped[str] = mapped_column(Text)

    # NULL keys never collide (NULLs are distinct on both databases), so only keyed actions are constrained.
    __table_args__ = (UniqueConstraint("task", "idempotency_key", name="uq_actions_task_idempotency_key"),
                      # a restart's search for leases still held (``load_granted_leases``)
                      Index("ix_actions_kind_state_finished_at", "kind", "state", "finished_at"))


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
