"""The agent's end of the direct channel (``managers/remote/channel_frames.py``): a unix socket on the agent's node
that answers the same fenced calls as its Ray actor does.

The socket lives in a directory only the agent's user can enter, with mode 0600, and a client must send the token
before anything else: a process of the host that can reach neither the directory nor the token (a sandbox, whose own
socket directories lie elsewhere) cannot call the agent. A request runs to its end even when its client goes away,
as a Ray call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from managers.remote.channel_frames import ACCEPTED, TOKEN_BYTES, FrameTooLarge, frame, read_frame
from managers.remote.replies import Reply

log = logging.getLogger("tangram.agent")

#: seconds a new connection has to send the token
TOKEN_TIMEOUT_S = 5.0

#: ``call(epoch, method, *args)``: the agent's fenced entry (``FencedAgent.call``)
AgentEntry = Callable[..., Awaitable[Reply]]


class ChannelServer:
    """Serves ``entry`` on the unix socket ``path`` (made on ``start``) to clients that send ``token``."""

    def __init__(self, entry: AgentEntry, path: Path, request_limit: int) -> None:
        """``request_limit``: the most bytes a request frame may have."""
        self._entry = entry
        self.path = path
        self._request_limit = request_limit
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Listen on ``path``, replacing a socket a previous agent of this node left there."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path.parent, 0o700)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, self.path)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), TOKEN_TIMEOUT_S)
            if not hmac.compare_digest(token, self.token):
                log.warning("agent channel %s: a client sent a wrong token; closed", self.path)
                return
            writer.write(ACCEPTED)
            while True:
                request = await read_frame(reader, self._request_limit)
                reply = await self._answer(request)
                writer.write(frame(reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the client went away (or never spoke): nothing is owed to it
        except FrameTooLarge as error:
            log.warning("agent channel %s: %s; closed", self.path, error)
        finally:
            writer.close()

    async def _answer(self, request: Any) -> Reply:
        epoch, method, args = request
        reply: Reply = await self._entry(epoch, method, *args)
        return reply
