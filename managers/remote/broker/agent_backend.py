"""A node's sandboxes driven through its node agent (``managers/remote/node/node_agent.py``): a ``SandboxBackend`` like
the Docker and local ones, so the CPU manager runs a node behind an agent exactly as one on its own host.

The transport is a function ``call(method, *args)`` that returns the agent's reply;
``managers/remote/broker/ray_agents.py`` makes one over a Ray actor. A transport failure (the agent or its node is gone)
arrives as an error reply like any other, with ``lost`` set, so the environment is reported lost and the action fails
with a code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from managers.cpu.live_output import STREAMS, LiveOutput
from managers.remote.replies import Reply
from sandboxes.backend import Executed, Leftover, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from sandboxes.exec_wire import ExecRequest, ExecResult
from sandboxes.executor_client import OutputSink
from sandboxes.file_wire import FileOp

T = TypeVar("T")

log = logging.getLogger("tangram.cpu")

#: how long a closing broker waits for an agent to drop its connections (one on a dead node never answers)
CLOSE_TIMEOUT_S = 5.0

#: ``call(method, *args)``: one call to the node's agent
AgentCall = Callable[..., Awaitable[Reply]]
#: how often a watched command's output is fetched from its agent
OUTPUT_POLL_S = 0.25


def answer(reply: Reply) -> Any:
    """The reply's value, or its error raised as the ``SandboxError`` the agent met."""
    error = reply.get("error")
    if error is not None:
        raise SandboxError(error["code"], error["message"], lost=error["lost"])
    return reply["ok"]


class AgentSandbox(Sandbox):
    """One sandbox on the agent's node, by its environment id."""

    def __init__(self, call: AgentCall, env_id: str, created: dict[str, Any], node: str) -> None:
        self._call = call
        self.env_id = env_id
        self.workdir = created["workdir"]
        self._description = {**created["describe"], "agent": node}

    async def set_cores(self, cores: frozenset[int]) -> None:
        answer(await self._call("set_cores", self.env_id, cores))

    async def run(self, request: ExecRequest) -> ExecResult:
        result: ExecResult = answer(await self._call("run", self.env_id, request))
        return result

    async def execute(self, tag: str, request: ExecRequest, on_output: OutputSink | None = None) -> Executed:
        """The agent's sandbox pins, runs and settles: one round trip rather than three. While ``on_output`` is
        watched (a ``LiveOutput`` someone reads), the output so far is polled from the agent every
        ``OUTPUT_POLL_S``, and the rest comes from the answer. Why polls rather than a stream of replies (Ray's
        streaming generators): an agent that streams to a broker frozen or cut off stalls until its reports time out,
        and so does the new leader's takeover through it."""
        running = asyncio.ensure_future(self._call("execute", self.env_id, tag, request))
        sent = dict.fromkeys(STREAMS, 0)
        try:
            while not running.done():
                await asyncio.wait({running}, timeout=OUTPUT_POLL_S)
                if running.done() or not isinstance(on_output, LiveOutput) or not on_output.watched:
                    continue
                pieces = (await self._call("output", self.env_id, tag, sent)).get("ok") or {}  # a failed poll: none
                for name, data in pieces.items():
                    on_output(name, data)
                    sent[name] += len(data)
        finally:
            running.cancel()  # a no-op once answered
        executed: Executed = answer(running.result())
        if on_output is not None:  # what came after the last poll (as text: the answer decoded the bytes)
            for name in STREAMS:
                rest = getattr(executed.result, name).encode()[sent[name]:]
                if rest:
                    on_output(name, rest)
        return executed

    async def repin(self, tag: str, cores: frozenset[int]) -> None:
        answer(await self._call("repin", self.env_id, tag, cores))

    async def files(self, op: FileOp[T]) -> T:
        """The agent's sandbox thaws, exchanges and freezes: one round trip."""
        done: T = answer(await self._call("files", self.env_id, op))
        return done

    async def snapshot(self) -> str:
        """Made by the agent's backend on its node, where the forks go."""
        image: str = answer(await self._call("snapshot", self.env_id))
        return image

    async def destroy(self) -> None:
        answer(await self._call("destroy", self.env_id))

    def describe(self) -> dict[str, Any]:
        return self._description


class AgentBackend(SandboxBackend):
    """The sandboxes of the node named ``node``, through its agent."""

    kind = "agent"

    def __init__(self, call: AgentCall, node: str, release: Callable[[], Awaitable[None]],
                 channel: Callable[[], str | None] = lambda: None) -> None:
        """``release()`` lets the agent go when the backend closes (its sandboxes stay on the node); ``channel()``
        is the socket the calls go over now (None: through Ray)."""
        self._call = call
        self.node = node
        self._release = release
        self._channel = channel
        self._node_backend: dict[str, Any] = {}

    async def start(self) -> None:
        described = answer(await self._call("describe"))
        self._node_backend = described["backend"]
        self.hardware = described["hardware"]

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return AgentSandbox(self._call, spec.env_id, answer(await self._call("create", spec)), self.node)

    async def adopt(self, broker_id: str) -> list[Leftover]:
        leftovers = []
        for left in answer(await self._call("adopt", broker_id)):
            created = left.pop("sandbox")
            leftover = Leftover(**left, sandbox=None)
            leftovers.append(leftover if created is None
                             else leftover.adopted(AgentSandbox(self._call, leftover.env_id, created, self.node)))
        return leftovers

    async def reap(self, broker_id: str) -> int:
        reaped: int = answer(await self._call("reap", broker_id))
        return reaped

    async def drop_snapshot(self, image: str) -> None:
        answer(await self._call("drop_snapshot", image))

    async def close(self) -> None:
        """Let the agent go; one already gone (or whose node is) has nothing to close."""
        try:
            error = (await asyncio.wait_for(self._call("close"), CLOSE_TIMEOUT_S)).get("error")
            if error is not None:
                log.warning("node %s: the agent did not close (%s)", self.node, error["message"])
        except TimeoutError:
            log.warning("node %s: the agent did not answer within %.0f s; let go", self.node, CLOSE_TIMEOUT_S)
        finally:
            await self._release()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind, "node_backend": self._node_backend, "channel": self._channel()}
