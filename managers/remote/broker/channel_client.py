"""The broker's end of the direct channel to an agent (``managers/remote/channel_frames.py``): a unix socket on its
host, or TLS over TCP pinned to the agent's certificate (``managers/remote/channel_tls.py``).

A connection carries one call at a time, so concurrent calls each take a connection of their own from a pool (kept
for the next call) and none waits behind a long command. A connection that breaks is dropped, never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from managers.remote.channel_frames import ACCEPTED, FrameTooLarge, frame, read_frame
from managers.remote.channel_tls import client_context
from managers.remote.replies import Reply

#: idle connections kept for later calls; more open while calls run at once, and close after them
POOL_SIZE = 16
#: seconds to connect (and, over TCP, to finish the TLS handshake) before the channel counts as unreachable
CONNECT_TIMEOUT_S = 5.0

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class ChannelUnreachable(Exception):
    """No connection could be made (or the agent refused the token): nothing was sent, the call may go another way."""


class ChannelBroken(Exception):
    """The connection failed after the call was sent: whether the agent ran it is unknown."""


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def usable(self) -> bool:
        """Not closed by either end (an agent that restarted has closed its side)."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class ChannelClient:
    """Calls to the agent that ``connect`` reaches (``where``, for messages), under ``token``."""

    def __init__(self, where: str, connect: Connect, token: bytes, reply_limit: int) -> None:
        """``reply_limit``: the most bytes an answer may have."""
        self.where = where
        self._connect = connect
        self._token = token
        self._reply_limit = reply_limit
        self._idle: list[_Connection] = []

    @classmethod
    def unix(cls, path: str, token: bytes, reply_limit: int) -> ChannelClient:
        """To the agent serving the unix socket ``path``."""
        return cls(path, functools.partial(asyncio.open_unix_connection, path), token, reply_limit)

    @classmethod
    def tls(cls, address: str, port: int, certificate: str, token: bytes, reply_limit: int) -> ChannelClient:
        """To the agent serving TLS on ``address``:``port`` under ``certificate`` (PEM), the only one accepted."""
        connect = functools.partial(asyncio.open_connection, address, port, ssl=client_context(certificate))
        return cls(f"tls://{address}:{port}", connect, token, reply_limit)

    async def call(self, epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
        """The agent's answer to ``method(*args)`` under ``epoch``; ``ChannelUnreachable`` or ``ChannelBroken``
        when the socket fails."""
        connection = await self._connection()
        try:
            connection.writer.write(frame((epoch, method, args)))
            await connection.writer.drain()
            reply: Reply = await read_frame(connection.reader, self._reply_limit)
        except (OSError, asyncio.IncompleteReadError, FrameTooLarge) as error:
            connection.close()
            raise ChannelBroken(f"the agent's channel {self.where} failed during {method}: "
                                f"{error or type(error).__name__}") from None
        except BaseException:  # cancelled mid-call: its answer would reach the next caller
            connection.close()
            raise
        if len(self._idle) < POOL_SIZE:
            self._idle.append(connection)
        else:
            connection.close()
        return reply

    async def connect(self) -> None:
        """Open a connection and keep it for the next call; ``ChannelUnreachable`` when none can be made."""
        self._idle.append(await self._connection())

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:
                return connection
            connection.close()
        try:
            reader, writer = await asyncio.wait_for(self._connect(), CONNECT_TIMEOUT_S)
        except OSError as error:  # TimeoutError and a TLS failure (another certificate) among them
            raise ChannelUnreachable(f"the agent's channel {self.where}: {error or type(error).__name__}") from None
        try:
            writer.write(self._token)
            accepted = await reader.readexactly(len(ACCEPTED)) == ACCEPTED
        except (OSError, asyncio.IncompleteReadError):
            accepted = False
        if not accepted:
            writer.close()
            raise ChannelUnreachable(f"the agent's channel {self.where} refused this broker's token")
        return _Connection(reader, writer)

    def close(self) -> None:
        for connection in self._idle:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                connection.close()
        self._idle.clear()
