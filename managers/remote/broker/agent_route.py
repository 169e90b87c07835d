"""One agent's calls (a node agent's or a service agent's), over its direct channel (issue 40), else through Ray.

The broker asks the agent (through Ray) where its channel is, saying which host the broker runs on: an agent on the
same host (the same boot id) answers with its unix socket, one elsewhere (or every agent, with ``channel = "tls"``)
with its TLS listener on its node's address. A socket the broker cannot open though it shares the agent's kernel
(containers of one host) gives way to TLS. The channel is opened beside the calls, which go through Ray until one
connection has been made and the agent took the token: a listener that a firewall hides costs the calls nothing
while the attempt runs out its timeout. An agent that serves none, or one older than the channel, keeps every call
on Ray. A call the channel could not send goes through Ray instead; one it lost after sending answers as Ray says
the agent is (died for good, or restarting: the call may be tried again), never by sending it again, since the agent
may have run it. Either way the channel is asked for again after ``RETRY_S``, twice as long after each channel that
could not be reached, up to ``RETRY_MAX_S``: an agent Ray restarted serves a new one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from managers.remote.broker.channel_client import ChannelBroken, ChannelClient, ChannelUnreachable
from managers.remote.channel_frames import host_identity
from managers.remote.replies import Reply, failed

log = logging.getLogger("tangram.agents")

#: seconds before the channel is asked for again after it failed or could not be had
RETRY_S = 30.0
#: the longest wait between attempts at a channel that could not be reached again and again
RETRY_MAX_S = 3600.0

#: ``ray_call(epoch, method, args)``: the call through the agent's Ray actor
RayCall = Callable[[int | None, str, tuple[Any, ...]], Awaitable[Reply]]
#: "auto": the unix socket on the broker's host, TLS elsewhere (or where the socket is out of reach); "tls": TLS for
#: every agent; "ray": every call through Ray
ChannelMode = Literal["auto", "tls", "ray"]


class AgentRoute:
    """Sends one agent's calls by the cheapest way that reaches it."""

    def __init__(self, ray_call: RayCall, agent: str, unavailable: str, reply_limit: int, mode: ChannelMode) -> None:
        """``agent`` names it in messages; ``unavailable`` is the code of a call lost in transit; ``reply_limit``
        bounds an answer on the channel."""
        self._ray_call = ray_call
        self._agent = agent
        self._unavailable = unavailable
        self._reply_limit = reply_limit
        self._tls = mode == "tls"
        self._client: ChannelClient | None = None
        self._ask_at = math.inf if mode == "ray" else 0.0
        self._retry_s = RETRY_S
        self._opening: asyncio.Task[None] | None = None

    @property
    def channel(self) -> str | None:
        """The channel the calls go over now (a socket's path, or ``tls://address:port``); None: through Ray."""
        return None if self._client is None else self._client.where

    async def send(self, epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
        if self._client is None and self._opening is None and time.monotonic() >= self._ask_at:
            self._opening = asyncio.create_task(self._open(epoch))
        if self._client is not None:
            try:
                return await self._client.call(epoch, method, args)
            except ChannelUnreachable as error:  # nothing sent: through Ray
                self._drop(str(error))
            except ChannelBroken as error:
                self._drop(str(error))
                return await self._lost_in_transit(epoch, str(error))
        return await self._ray_call(epoch, method, args)

    async def _open(self, epoch: int | None) -> None:
        """Ask where the channel is and connect to it once; the calls meanwhile go through Ray. A unix socket the
        broker cannot reach though the agent shares its kernel (containers of one host) gives way to TLS."""
        try:
            self._ask_at = time.monotonic() + RETRY_S  # the next attempt, unless this one succeeds
            where = await self._ask(epoch, self._tls)
            if where is None:
                return
            failure = await self._connect(where)
            if failure is not None and "path" in where:
                where = await self._ask(epoch, True)
                if where is None:
                    return
                failure = await self._connect(where)
            if failure is not None:
                self._back_off(failure)
        finally:
            self._opening = None

    async def _ask(self, epoch: int | None, tls: bool) -> dict[str, Any] | None:
        """The agent's answer to where its channel is; None where it serves none (asked again later) or cannot say
        (an agent older than the channel: never asked again)."""
        try:
            where: dict[str, Any] | None = (await self._where(epoch, tls)).get("ok")
        except Exception as error:  # noqa: BLE001 - an agent older than the channel has no such method (Ray wraps it)
            log.info("%s serves no direct channel (%s): its calls go through Ray", self._agent, error)
            self._ask_at = math.inf
            return None
        return where

    async def _connect(self, where: dict[str, Any]) -> str | None:
        """Take the channel ``where`` says once a connection to it is made; else why not."""
        try:
            if "path" in where:
                client = ChannelClient.unix(where["path"], where["token"], self._reply_limit)
            else:
                client = ChannelClient.tls(where["address"], where["port"], where["certificate"], where["token"],
                                           self._reply_limit)
            await client.connect()
        except (ChannelUnreachable, OSError, ValueError) as error:  # OSError, ValueError: a certificate TLS refused
            return str(error) or type(error).__name__
        self._client = client
        self._retry_s = RETRY_S
        log.info("%s: called over its channel %s", self._agent, client.where)
        return None

    def _where(self, epoch: int | None, tls: bool | None = None) -> Awaitable[Reply]:
        """The agent's answer (through Ray) to where its channel for this broker is (over TLS with ``tls``, as the
        route's mode says when None): also Ray's word on the agent."""
        return self._ray_call(epoch, "channel", (host_identity(), self._tls if tls is None else tls))

    async def _lost_in_transit(self, epoch: int | None, why: str) -> Reply:
        """The answer to a call the channel lost: Ray's word on the agent (died for good, or restarting) where it
        has one, else that the call may be tried again."""
        probe = await self._where(epoch)
        if "error" in probe:
            return probe
        return failed(self._unavailable, f"{self._agent} is unavailable: {why}")

    def _drop(self, why: str) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None
        self._back_off(why)

    def _back_off(self, why: str) -> None:
        log.warning("%s: no channel (%s); calls go through Ray for %.0f s", self._agent, why, self._retry_s)
        self._ask_at = time.monotonic() + self._retry_s
        self._retry_s = min(2 * self._retry_s, RETRY_MAX_S)

    def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self._client is not None:
            self._client.close()
            self._client = None
