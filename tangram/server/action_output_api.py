"""``GET /v1/actions/{id}/output``: an ``exec`` action's stdout and stderr while it runs, as server-sent events.

Why: a long command (a test suite, a build) says nothing until its record is terminal; an agent or a person watching
it wants its output as it comes. Events, in order:

* ``event: stdout`` / ``event: stderr`` with ``data: {"data": "..."}``: the next piece of that stream, its bytes
  decoded as UTF-8 with replacement (a character split across pieces is decoded whole; JSON keeps newlines and
  control bytes on one ``data:`` line). Each stream carries at most the action's ``output_limit`` bytes in all: the
  bytes its record keeps.
* ``event: end`` with ``data: {"id": ..., "state": ..., "exit_code": ..., "error": ...}`` once the action is terminal
  (``error``: its code and message, or null); the stream then closes.

A queued action's stream waits (``: waiting`` comment lines keep it open) until its command starts. An action that
ended, or whose sandbox cannot stream (an executor from an older broker, a Docker engine reached without the fast
path, a node behind an agent), streams its record's kept output before ``end``. A client that drops the stream
changes nothing for the action: readers only read the manager's buffer (``managers/cpu/live_output.py``).
"""

from __future__ import annotations

import asyncio
import codecs
from typing import Any

import orjson
from aiohttp import web

from managers.cpu.live_output import STREAMS, LiveOutput, LiveOutputs
from tangram.broker import Broker
from tangram.core.action import Action, Kind
from tangram.core.errors import Conflict
from tangram.server.auth import principal_of
from tangram.server.common import BROKER

EVENT_STREAM = "text/event-stream"
#: a waiting stream sends a comment this often: proxies keep it open, and a client that left is noticed
HEARTBEAT_S = 15.0


def _outputs(broker: Broker, action: Action) -> LiveOutputs:
    """The live output buffers of the manager running the action; 409 for an action with no output stream."""
    outputs = getattr(broker.executor.get(action.kind), "outputs", None)
    if action.kind is not Kind.EXEC or not isinstance(outputs, LiveOutputs):
        raise Conflict("id", f"action {action.id} is a {action.kind.value} action: only exec actions have an output "
                             f"stream")
    return outputs


class _Events:
    """The response's server-sent events."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in STREAMS}

    async def send(self, event: str, data: Any) -> None:
        await self.response.write(b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    async def piece(self, stream: str, data: bytes) -> None:
        text = self.decoders[stream].decode(data)
        if text:
            await self.send(stream, {"data": text})

    async def flush(self) -> None:
        """What a stream's last piece left undecoded: a character cut off by the limit, as a replacement."""
        for stream in STREAMS:
            text = self.decoders[stream].decode(b"", final=True)
            if text:
                await self.send(stream, {"data": text})

    async def stored(self, action: Action, streams: tuple[str, ...]) -> None:
        """The record's kept output of ``streams`` (a timed-out or out-of-memory command keeps it in its error)."""
        record = next((body for body in (action.result, action.error) if isinstance(body, dict) and "stdout" in body),
                      {})
        for stream in streams:
            if record.get(stream):
                await self.send(stream, {"data": record[stream]})

    async def heartbeat(self) -> None:
        await self.response.write(b": waiting\n\n")


def _settled(broker: Broker, action: Action) -> bool:
    """Terminal, or never to run in this process (a draining broker's queued action)."""
    return action.state.terminal or (broker.draining and action.id not in broker.running)


async def _started(broker: Broker, outputs: LiveOutputs, action: Action, events: _Events) -> LiveOutput | None:
    """The action's live output once its command starts, or None when it settled without one being seen."""
    while not _settled(broker, action):
        live = outputs.get(action.id)
        if live is not None:
            return live
        started = asyncio.ensure_future(outputs.started(action.id))
        waited = asyncio.ensure_future(broker.wait(action.id, HEARTBEAT_S))
        try:
            await asyncio.wait((started, waited), return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
            waited.cancel()
        if started.done() and not started.cancelled():
            return started.result()
        await events.heartbeat()
    return None


async def _stream(broker: Broker, outputs: LiveOutputs, action: Action, events: _Events) -> None:
    live = await _started(broker, outputs, action, events)
    if live is not None:
        async for stream, data in live.follow():
            await events.piece(stream, data)
        await events.flush()
        while not _settled(broker, action):  # its command answered; the broker records it at once
            action = await broker.wait(action.id, HEARTBEAT_S)
    # what no piece was streamed of: all of it for an ended action or a sandbox that cannot stream
    await events.stored(action, tuple(name for name in STREAMS if live is None or not live.data[name]))
    error = action.error
    await events.send("end", {"id": action.id, "state": action.state.value,
                              "exit_code": next((body.get("exit_code") for body in (action.result, error)
                                                 if isinstance(body, dict) and "exit_code" in body), None),
                              "error": None if error is None else {"code": error.get("code"),
                                                                   "message": error.get("message")}})


async def action_output(request: web.Request) -> web.StreamResponse:
    """Stream the action's output (see the module's docstring); 404 for an unknown id or another task's action,
    409 for an action that is not an ``exec``."""
    broker = request.app[BROKER]
    action = await broker.get(request.match_info["id"], principal_of(request).task)
    outputs = _outputs(broker, action)
    response = web.StreamResponse(headers={"Content-Type": EVENT_STREAM, "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        await _stream(broker, outputs, action, _Events(response))
        await response.write_eof()
    except ConnectionResetError:  # the client left: nothing of the action depends on its stream
        pass
    return response


def add_action_output_routes(app: web.Application) -> None:
    app.router.add_get("/v1/actions/{id}/output", action_output)
