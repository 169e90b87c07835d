"""A node agent: one node's sandbox backend behind plain, picklable calls (issue 17).

The agent runs on its node (``managers/remote/broker/ray_agents.py`` places it there as a Ray actor) and opens that
node's own backend, so the node keeps the fast path (cgroup files and the executor's unix socket) that only works on the
engine's host. A broker elsewhere drives it through ``managers/remote/broker/agent_backend.py``, which is a
``SandboxBackend`` like any other: the CPU manager does not know that a node is remote.

Every call answers as ``managers/remote/replies.py`` says, so a sandbox error crosses the process boundary with its
code intact, and comes through ``FencedAgent.call``, so a deposed leader's call is refused before it has any effect
(a new leader's first call, at its start, raises the agent's epoch). The agent checks what reaches it as the REST
API does (file paths stay inside the working directory, bounded file sets): the cluster is the trust boundary, and
a caller inside it that skipped the API must not escape a sandbox either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from managers.cpu.exec_spec import ExecLimits, check_files
from managers.cpu.live_output import LiveOutput
from managers.remote.channel_frames import FRAME_SLACK_BYTES
from managers.remote.node.agent_channels import AgentChannels
from managers.remote.replies import FencedAgent, replying
from sandboxes.backend import Executed, Leftover, NodeHardware, Sandbox, SandboxBackend, SandboxError, SandboxSpec
from sandboxes.exec_wire import ExecRequest, ExecResult
from sandboxes.file_wire import FileData, ReadFile, WriteFiles, Written
from tangram.core.errors import RequestError, TooLarge

log = logging.getLogger("tangram.agent")


class NodeAgent(FencedAgent):
    """One node's sandboxes, by environment id."""

    def __init__(self, open_backend: Callable[[], Awaitable[SandboxBackend]], limits: ExecLimits,
                 hardware: NodeHardware, restarted_for: str | None = None, channel_path: Path | None = None,
                 channel_address: str | None = None) -> None:
        """``open_backend()`` opens this node's backend (started) on the agent's first call; ``limits`` bound the
        file sets it writes into new sandboxes; ``hardware`` is what the node offers, reported to the broker. An
        agent restarted while broker ``restarted_for`` runs takes that broker's sandboxes back by their labels as
        it opens, so its environments go on where they were. ``channel_path``: where it serves a broker on its host
        without Ray (``channel``); None: it serves none. ``channel_address``: the node's address, where it serves a
        broker elsewhere over TLS; None: it does not."""
        self._open_backend = open_backend
        self._limits = limits
        self._hardware = hardware
        self._restarted_for = restarted_for
        self._backend: SandboxBackend | None = None
        self._opening = asyncio.Lock()
        self._sandboxes: dict[str, Sandbox] = {}
        #: the snapshot images this agent made (forks), the only ones it removes
        self._snapshots: set[str] = set()
        #: the output so far of the commands running now, by (environment, tag)
        self._outputs: dict[tuple[str, str], LiveOutput] = {}
        request_limit = limits.max_files_bytes + limits.max_stdin_bytes + limits.max_command_bytes + FRAME_SLACK_BYTES
        self._channels = AgentChannels(self.call, channel_path, channel_address, request_limit)

    async def _opened(self) -> SandboxBackend:
        if self._backend is not None:
            return self._backend
        async with self._opening:
            if self._backend is None:
                backend = await self._open_backend()
                if self._restarted_for is not None:
                    self._hold(await backend.adopt(self._restarted_for))
                    log.info("agent restarted: took back %d sandbox(es) of broker %s", len(self._sandboxes),
                             self._restarted_for)
                self._backend = backend
        return self._backend

    def _hold(self, leftovers: list[Leftover]) -> None:
        for leftover in leftovers:
            if leftover.sandbox is not None:
                self._sandboxes[leftover.env_id] = leftover.sandbox

    async def _held(self, env_id: str) -> Sandbox:
        await self._opened()  # a restarted agent has taken its sandboxes back first
        sandbox = self._sandboxes.get(env_id)
        if sandbox is None:
            raise SandboxError("environment_lost", f"the node's agent holds no sandbox {env_id!r} (it restarted "
                                                   f"or the sandbox was removed)", lost=True)
        return sandbox

    @replying
    async def describe(self) -> dict[str, Any]:
        """The node's backend as it describes itself, and the node's hardware."""
        return {"backend": (await self._opened()).describe(), "hardware": self._hardware}

    @replying
    async def channel(self, broker_host: str, tls: bool) -> dict[str, Any] | None:
        """Where a broker on host ``broker_host`` calls this agent without Ray (``AgentChannels.where``)."""
        return await self._channels.where(broker_host, tls)

    @replying
    async def create(self, spec: SandboxSpec) -> dict[str, Any]:
        """A new sandbox; answers where it runs (its working directory and description)."""
        try:
            check_files(spec.files, "files", self._limits)
        except RequestError as error:
            raise SandboxError("bad_files", f"{error.field}: {error.reason}") from None
        sandbox = await (await self._opened()).create(spec)
        self._sandboxes[spec.env_id] = sandbox
        return {"workdir": sandbox.workdir, "describe": sandbox.describe()}

    @replying
    async def adopt(self, broker_id: str) -> list[dict[str, Any]]:
        """The node's leftovers of ``broker_id``, as dicts; the adopted sandboxes are held by their ids."""
        leftovers = await (await self._opened()).adopt(broker_id)
        self._hold(leftovers)
        answer = []
        for leftover in leftovers:
            sandbox = leftover.sandbox
            answer.append({"env_id": leftover.env_id, "task": leftover.task, "trajectory": leftover.trajectory,
                           "image": leftover.image, "memory_mb": leftover.memory_mb,
                           "created_at": leftover.created_at, "lost_reason": leftover.lost_reason,
                           "sandbox": None if sandbox is None else {"workdir": sandbox.workdir,
                                                                    "describe": sandbox.describe()}})
        return answer

    @replying
    async def reap(self, broker_id: str) -> int:
        return await (await self._opened()).reap(broker_id)

    @replying
    async def set_cores(self, env_id: str, cores: frozenset[int]) -> None:
        sandbox = await self._held(env_id)
        await sandbox.set_cores(cores)

    @replying
    async def run(self, env_id: str, request: ExecRequest) -> ExecResult:
        self._check_request(request)
        sandbox = await self._held(env_id)
        return await sandbox.run(request)

    @replying
    async def execute(self, env_id: str, tag: str, request: ExecRequest) -> Executed:
        """One action's command with its pinning and settling, in the one call an action costs the broker. Its
        output so far is kept while it runs, for ``output``."""
        self._check_request(request)
        sandbox = await self._held(env_id)
        output = self._outputs[(env_id, tag)] = LiveOutput(request.output_limit)
        try:
            return await sandbox.execute(tag, request, output)
        finally:
            del self._outputs[(env_id, tag)]

    @replying
    async def output(self, env_id: str, tag: str, sent: dict[str, int]) -> dict[str, bytes] | None:
        """What the running command ``tag`` has written past ``sent`` bytes of each stream (a broker polls it
        while someone watches the action's output); None when no such command runs here."""
        output = self._outputs.get((env_id, tag))
        if output is None:
            return None
        return {name: bytes(data[sent.get(name, 0):]) for name, data in output.data.items()}

    def _check_request(self, request: ExecRequest) -> None:
        """A command's stdin within what the API lets through (``max_stdin_bytes``)."""
        if request.stdin is not None and len(request.stdin) > self._limits.max_stdin_bytes:
            raise SandboxError("bad_request", f"stdin: {len(request.stdin)} bytes; the limit is "
                                              f"{self._limits.max_stdin_bytes}")

    @replying
    async def repin(self, env_id: str, tag: str, cores: frozenset[int]) -> None:
        sandbox = await self._held(env_id)
        await sandbox.repin(tag, cores)

    @replying
    async def files(self, env_id: str, op: WriteFiles | ReadFile) -> Written | FileData:
        """A file op in the sandbox; a write's files are checked as the API checks them (paths inside the working
        directory, bounded counts and bytes), a read is bounded by the same limit."""
        try:
            if isinstance(op, WriteFiles):
                check_files({**dict.fromkeys(op.dirs, b""), **op.files}, "files", self._limits)
            elif op.limit > self._limits.max_files_bytes:
                raise TooLarge("path", f"a read is bounded by {self._limits.max_files_bytes} bytes")
        except RequestError as error:
            raise SandboxError("file_bad_request", f"{error.field}: {error.reason}") from None
        sandbox = await self._held(env_id)
        return await sandbox.files(op)

    @replying
    async def snapshot(self, env_id: str) -> str:
        """An image of the sandbox's filesystem, for forks made on this node (the broker holds the sandbox idle)."""
        sandbox = await self._held(env_id)
        image = await sandbox.snapshot()
        self._snapshots.add(image)
        return image

    @replying
    async def drop_snapshot(self, image: str) -> None:
        """Remove a snapshot of this agent's once no fork uses it; another image is not the broker's to remove."""
        if image not in self._snapshots:
            raise SandboxError("bad_request", f"image {image!r} is not a snapshot this node's agent made")
        await (await self._opened()).drop_snapshot(image)

    @replying
    async def destroy(self, env_id: str) -> None:
        await self._opened()
        sandbox = self._sandboxes.pop(env_id, None)
        if sandbox is not None:
            await sandbox.destroy()

    @replying
    async def close(self) -> None:
        """Drop the backend's connections; sandboxes stay (the broker destroyed or keeps them)."""
        if self._backend is not None:
            await self._backend.close()
            self._backend = None
        self._sandboxes.clear()
        await self._channels.close()
