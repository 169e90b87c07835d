"""Whether a node behind an agent is in service (issue 17), for CPU and GPU nodes alike: lost, with the reason, when
its Ray node leaves the cluster; in service again when it comes back. An action that lost touch with a node's agent
waits briefly for the verdict, so it ends ``node_lost`` with the reason rather than as an agent restarting."""

from __future__ import annotations

import asyncio
import contextlib

#: how long an action whose agent stopped answering waits to learn whether the node is lost: Ray marks a dead raylet
#: after its health checks (about 4 s at 0.5 s x 3, deploy/README.md), the membership polls every 0.5 s
NODE_FATE_S = 6.0


class NodeStanding:
    """A node's standing: ``lost`` is why it is out of service (None while it serves)."""

    def __init__(self) -> None:
        self.lost: str | None = None
        #: set when the node is lost, for actions that lost touch with it to learn their fate
        self.gone = asyncio.Event()

    def lose(self, reason: str) -> None:
        self.lost = reason
        self.gone.set()

    def returned(self) -> None:
        self.lost, self.gone = None, asyncio.Event()

    async def lost_within(self, seconds: float = NODE_FATE_S) -> str | None:
        """Why the node is lost, if it is or is declared so within ``seconds``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.gone.wait(), seconds)
        return self.lost
