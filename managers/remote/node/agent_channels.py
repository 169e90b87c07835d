"""What an agent offers a broker that asks for its direct channel (``managers/remote/broker/agent_route.py``): its
unix socket where the broker shares its host, else TLS on the node's address, each opened on the first ask. Node
agents and service agents offer it alike."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from managers.remote.channel_frames import host_identity
from managers.remote.node.channel_server import AgentEntry, ChannelServer


class AgentChannels:
    """``entry``'s channels: the unix socket ``path``, in a directory private to the agent that also holds its TLS
    key while it loads (None: no channel at all), and TLS on ``address`` (None: no TLS)."""

    def __init__(self, entry: AgentEntry, path: Path | None, address: str | None, request_limit: int) -> None:
        """``request_limit``: the most bytes a request frame may have."""
        self._entry = entry
        self._path = path
        self._address = address
        self._request_limit = request_limit
        self._server: ChannelServer | None = None
        self._opening = asyncio.Lock()

    async def where(self, broker_host: str, tls: bool) -> dict[str, Any] | None:
        """Where a broker on host ``broker_host`` (its ``host_identity``) calls the agent, with the token to send:
        the unix socket on this host, else (or with ``tls``) TLS, with the certificate to pin; None where the agent
        serves no such channel."""
        if self._path is None:
            return None
        tls_address: str | None = None  # None: the unix socket
        if tls or broker_host != host_identity():
            if self._address is None:
                return None
            tls_address = self._address
        async with self._opening:
            if self._server is None:
                self._server = ChannelServer(self._entry, self._path, self._request_limit)
            server = self._server
            if tls_address is None:
                if not server.serves_unix:
                    await server.start_unix()
                return {"path": str(server.path), "token": server.token}
            listener = server.tls or await server.start_tls(tls_address)
        return {"address": listener.address, "port": listener.port, "certificate": listener.certificate,
                "token": server.token}

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None
