"""A trajectory environment as the CPU manager tracks it: where it lives, what it reserves, what runs in it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from managers.cpu.turns import Turns
from sandboxes.backend import Sandbox


class EnvState(StrEnum):
    PENDING = "pending"  # placed on a node, memory reserved, sandbox not created yet
    READY = "ready"
    LOST = "lost"  # the sandbox died (e.g. killed for memory); actions naming it fail until it is deleted
    DESTROYED = "destroyed"


class LossCause(StrEnum):
    """Why an environment was lost, in a few fixed words: a metric's label (``lost_reason`` says it in full)."""

    SANDBOX_DIED = "sandbox_died"  # its sandbox or executor died under a command, file op, resize or snapshot
    CORES_UNSETTLED = "cores_unsettled"  # its cores could not be set back after a command
    NODE_LEFT = "node_left"
    GONE_AT_RESTART = "gone_at_restart"  # a previous run's sandbox was dead when this run took it over


@dataclass(eq=False)
class Environment:
    id: str
    task: str
    trajectory: str | None
    node: str
    image: str
    memory_mb: int
    files: dict[str, bytes] = field(default_factory=dict, repr=False)
    #: who its executor and commands run as ("UID:GID" or "root"; None: not known, an environment taken over
    #: after a restart)
    sandbox_user: str | None = None
    #: its sandbox's egress allow-list (None: no network)
    network: tuple[str, ...] | None = None
    #: the action whose allocation reserved it, and whose ``files`` it is created with (None: made through
    #: ``POST /v1/environments``, or taken over after a restart)
    reserved_by: str | None = None
    #: made for one action without a trajectory: destroyed when that action ends
    ephemeral: bool = False
    state: EnvState = EnvState.PENDING
    sandbox: Sandbox | None = None
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    #: the ids of the actions running in it (their cores are the sandbox's own business: ``Sandbox.execute``)
    running: set[str] = field(default_factory=set)
    #: its commands' and file ops' turns (``managers/cpu/turns.py``)
    turns: Turns = field(default_factory=Turns, repr=False)
    lost_reason: str | None = None
    creating: asyncio.Task[Sandbox] | None = field(default=None, repr=False)
    #: a fork's: the snapshot image of its source its sandbox is created from (``managers/cpu/environment_fork.py``)
    snapshot: str | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "task": self.task, "trajectory": self.trajectory, "node": self.node,
                "image": self.image, "memory_mb": self.memory_mb, "sandbox_user": self.sandbox_user,
                "network": {"mode": "none"} if self.network is None else {"mode": "proxy",
                                                                          "allow": list(self.network)},
                "state": self.state.value,
                "created_at": self.created_at, "last_used": self.last_used, "running_actions": len(self.running),
                "lost_reason": self.lost_reason, "sandbox": self.sandbox.describe() if self.sandbox else None}


#: a CPU allocation's handle: the environment it runs in (None: deleted since submit, the action fails at run),
#: its node and its cores
CpuHandle = tuple[Environment | None, str, tuple[int, ...]]
