"""The agent's end of the direct channel (``managers/remote/channel_frames.py``): a unix socket for a broker on the
agent's host, TLS over TCP for one elsewhere, both answering the same fenced calls as its Ray actor does.

The socket lives in a directory only the agent's user can enter, with mode 0600; the TCP listener, on the node's
address, speaks only TLS under the agent's own certificate (``managers/remote/channel_tls.py``). Either way a client
must send the token before anything else: a process that can reach neither the directory nor the token (a sandbox,
whose own socket directories lie elsewhere, or another host) cannot call the agent. Connections that have not sent
the token yet are bounded in number and in time. A request runs to its end even when its client goes away, as a Ray
call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from managers.remote.channel_frames import ACCEPTED, TOKEN_BYTES, FrameTooLarge, frame, read_frame
from managers.remote.channel_tls import server_context
from managers.remote.replies import Reply

log = logging.getLogger("tangram.agent")

#: seconds a new connection has to finish its TLS handshake, and then to send the token
TOKEN_TIMEOUT_S = 5.0
#: connections that have not sent the token yet, past which new ones are closed at once
UNAUTHENTICATED_LIMIT = 64

#: ``call(epoch, method, *args)``: the agent's fenced entry (``FencedAgent.call``)
AgentEntry = Callable[..., Awaitable[Reply]]


@dataclass(frozen=True)
class TlsListener:
    """Where the agent listens for TLS over TCP, and the certificate a client pins."""

    address: str
    port: int
    certificate: str


class ChannelServer:
    """Serves ``entry`` to clients that send ``token``: on the unix socket ``path`` and, once asked, over TCP."""

    def __init__(self, entry: AgentEntry, path: Path, request_limit: int) -> None:
        """``request_limit``: the most bytes a request frame may have."""
        self._entry = entry
        self.path = path
        self._request_limit = request_limit
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._servers: list[asyncio.AbstractServer] = []
        self._unix: asyncio.AbstractServer | None = None
        self.tls: TlsListener | None = None
        self._unauthenticated = 0
        self._made_directory = False

    async def start_unix(self) -> None:
        """Listen on ``path``, replacing a socket a previous agent of this node left there."""
        self._private_directory()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._unix = await asyncio.start_unix_server(self._serve, self.path)
        self._servers.append(self._unix)
        os.chmod(self.path, 0o600)

    async def start_tls(self, address: str) -> TlsListener:
        """Listen for TLS over TCP on ``address`` (the node's address), on a port the system picks."""
        self._private_directory()
        context, certificate = server_context(address, self.path.parent)
        server = await asyncio.start_server(self._serve, address, 0, ssl=context,
                                            ssl_handshake_timeout=TOKEN_TIMEOUT_S)
        self._servers.append(server)
        port = server.sockets[0].getsockname()[1]
        self.tls = TlsListener(address, port, certificate)
        log.info("agent channel: TLS on %s port %d", address, port)
        return self.tls

    @property
    def serves_unix(self) -> bool:
        return self._unix is not None

    async def close(self) -> None:
        """Stop listening. Connections open now end with their clients (``close`` itself may be a call on one: waiting
        for them, as ``wait_closed`` does from Python 3.12 on, would wait for itself)."""
        for server in self._servers:
            server.close()
        if self._unix is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._made_directory:
            with contextlib.suppress(OSError):  # not empty: something else of the agent's lives there
                self.path.parent.rmdir()

    def _private_directory(self) -> None:
        """The socket's directory, mode 0700; made here (and removed on ``close``) where it does not exist yet."""
        with contextlib.suppress(FileExistsError):
            self.path.parent.mkdir(parents=True, mode=0o700)
            self._made_directory = True
        os.chmod(self.path.parent, 0o700)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._unauthenticated >= UNAUTHENTICATED_LIMIT:
            writer.close()
            return
        try:
            self._unauthenticated += 1
            try:
                token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), TOKEN_TIMEOUT_S)
            finally:
                self._unauthenticated -= 1
            if not hmac.compare_digest(token, self.token):
                log.warning("agent channel %s: a client sent a wrong token; closed", self._where(writer))
                return
            writer.write(ACCEPTED)
            while True:
                request = await read_frame(reader, self._request_limit)
                reply = await self._answer(request)
                writer.write(frame(reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, OSError):  # OSError: a connection or TLS failure, or the token's timeout
            pass  # the client went away (or never spoke): nothing is owed to it
        except FrameTooLarge as error:
            log.warning("agent channel %s: %s; closed", self._where(writer), error)
        finally:
            writer.close()

    def _where(self, writer: asyncio.StreamWriter) -> str:
        peer = writer.get_extra_info("peername")
        return str(self.path) if not peer else f"TLS from {peer[0]}"

    async def _answer(self, request: Any) -> Reply:
        epoch, method, args = request
        reply: Reply = await self._entry(epoch, method, *args)
        return reply
