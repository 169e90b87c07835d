"""A node agent: one node's sandbox backend behind plain, picklable calls (issue 17).

The agent runs on its node (``managers/ray_agents.py`` places it there as a Ray actor) and opens that node's own
backend, so the node keeps the fast path (cgroup files and the executor's unix socket) that only works on the
engine's host. A broker elsewhere drives it through ``managers/agent_backend.py``, which is a ``SandboxBackend``
like any other: the CPU manager does not know that a node is remote.

Every call answers ``{"ok": value}`` or ``{"error": {"code", "message", "lost"}}`` rather than raising, so a
sandbox error crosses the process boundary with its code intact. The agent checks what reaches it as the REST API
does (file paths stay inside the working directory, bounded file sets): the cluster is the trust boundary, and a
caller inside it that skipped the API must not escape a sandbox either.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import PurePosixPath
from typing import Any

from sandboxes.backend import Sandbox, SandboxBackend, SandboxError, SandboxSpec

log = logging.getLogger("tangram.agent")

Reply = dict[str, Any]


def ok(value: Any = None) -> Reply:
    return {"ok": value}


def failed(error: SandboxError) -> Reply:
    return {"error": {"code": error.code, "message": error.message, "lost": error.lost}}


def check_files(files: Mapping[str, bytes], max_bytes: int) -> None:
    """A file set the agent writes into a new sandbox: relative paths that stay inside the working directory, and
    at most ``max_bytes`` in all. Raises ``SandboxError("bad_files")``."""
    total = 0
    for path, content in files.items():
        parts = PurePosixPath(path).parts
        if not parts or PurePosixPath(path).is_absolute() or ".." in parts or "\0" in path:
            raise SandboxError("bad_files", f"file path {path!r} must stay inside the working directory")
        total += len(content)
    if total > max_bytes:
        raise SandboxError("bad_files", f"the files hold {total} bytes, more than the agent takes ({max_bytes})")


class NodeAgent:
    """One node's sandboxes, by environment id."""

    def __init__(self, open_backend: Callable[[], Awaitable[SandboxBackend]], max_file_bytes: int) -> None:
        """``open_backend()`` opens this node's backend (started) on the agent's first call."""
        self._open_backend = open_backend
        self._max_file_bytes = max_file_bytes
        self._backend: SandboxBackend | None = None
        self._sandboxes: dict[str, Sandbox] = {}

    async def _opened(self) -> SandboxBackend:
        if self._backend is None:
            self._backend = await self._open_backend()
        return self._backend

    def _sandbox(self, env_id: str) -> Sandbox:
        sandbox = self._sandboxes.get(env_id)
        if sandbox is None:
            raise SandboxError("environment_lost", f"the node's agent holds no sandbox {env_id!r} (it restarted "
                                                   f"or the sandbox was removed)", lost=True)
        return sandbox

    async def describe(self) -> Reply:
        try:
            return ok((await self._opened()).describe())
        except SandboxError as error:
            return failed(error)

    async def create(self, spec: SandboxSpec) -> Reply:
        """A new sandbox; answers where it runs (its working directory and description)."""
        try:
            check_files(spec.files, self._max_file_bytes)
            sandbox = await (await self._opened()).create(spec)
        except SandboxError as error:
            return failed(error)
        self._sandboxes[spec.env_id] = sandbox
        return ok({"workdir": sandbox.workdir, "describe": sandbox.describe()})

    async def adopt(self, broker_id: str) -> Reply:
        """The node's leftovers of ``broker_id``, as dicts; the adopted sandboxes are held by their ids."""
        try:
            leftovers = await (await self._opened()).adopt(broker_id)
        except SandboxError as error:
            return failed(error)
        answer = []
        for leftover in leftovers:
            sandbox = leftover.sandbox
            if sandbox is not None:
                self._sandboxes[leftover.env_id] = sandbox
            answer.append({"env_id": leftover.env_id, "task": leftover.task, "trajectory": leftover.trajectory,
                           "image": leftover.image, "memory_mb": leftover.memory_mb,
                           "created_at": leftover.created_at, "lost_reason": leftover.lost_reason,
                           "sandbox": None if sandbox is None else {"workdir": sandbox.workdir,
                                                                    "describe": sandbox.describe()}})
        return ok(answer)

    async def reap(self, broker_id: str) -> Reply:
        try:
            return ok(await (await self._opened()).reap(broker_id))
        except SandboxError as error:
            return failed(error)

    async def set_cores(self, env_id: str, cores: frozenset[int]) -> Reply:
        try:
            await self._sandbox(env_id).set_cores(cores)
        except SandboxError as error:
            return failed(error)
        return ok()

    async def set_action_cores(self, env_id: str, tag: str, cores: frozenset[int]) -> Reply:
        try:
            await self._sandbox(env_id).set_action_cores(tag, cores)
        except SandboxError as error:
            return failed(error)
        return ok()

    async def run(self, env_id: str, request: dict[str, Any]) -> Reply:
        try:
            return ok(await self._sandbox(env_id).run(request))
        except SandboxError as error:
            return failed(error)

    async def destroy(self, env_id: str) -> Reply:
        sandbox = self._sandboxes.pop(env_id, None)
        try:
            if sandbox is not None:
                await sandbox.destroy()
        except SandboxError as error:
            return failed(error)
        return ok()

    async def close(self) -> Reply:
        """Drop the backend's connections; sandboxes stay (the broker destroyed or keeps them)."""
        if self._backend is not None:
            await self._backend.close()
            self._backend = None
        self._sandboxes.clear()
        return ok()
