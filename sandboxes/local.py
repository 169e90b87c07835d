"""Sandboxes as plain local processes, so ``tangram serve`` runs on a machine without Docker.

Each environment is a directory plus the same executor the containers run, as a child process listening on a
unix socket. Commands get exactly their cores (``sched_setaffinity``) and an address-space limit (RLIMIT_AS) for
the environment's memory. Isolation is much weaker than a container's: commands share this host's filesystem,
network, users and process table, idle background processes are not frozen, and memory is limited per command,
not per environment. Use it for development and trusted workloads only (the README says so).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import psutil

from sandboxes.backend import (
    LABEL_EPHEMERAL,
    MAX_LABELS_BYTES,
    Leftover,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    repin_via_executor,
)
from sandboxes.exec_wire import ExecRequest, ExecResult
from sandboxes.executor_client import EXECUTOR_PATH, ExecutorUnavailable, OutputSink, call, wait_ready
from sandboxes.untrusted_paths import UntrustedPath, read_regular

READY_TIMEOUT_S = 15.0
ADOPT_TIMEOUT_S = 5.0
MARKER = "TANGRAM_ENVIRONMENT"
#: the environment's SandboxSpec labels, so that a restarted broker can adopt it
LABELS_FILE = "labels.json"


def _executor_of(env_id: str) -> psutil.Process | None:
    """The environment's serving executor, found by the marker it carries."""
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "serve" in (process.info["cmdline"] or []) and process.environ().get(MARKER) == env_id:
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


def kill_marked(env_ids: set[str]) -> None:
    """SIGKILL every process carrying one of these environments' marker (the executor passes it to commands)."""
    for process in psutil.process_iter(["pid"]):
        try:
            if process.environ().get(MARKER) in env_ids:
                process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


class LocalSandbox(Sandbox):
    def __init__(self, env_id: str, root: Path, process: psutil.Process, memory_mb: int) -> None:
        self.env_id = env_id
        self.root = root
        self.workdir = str(root / "workspace")
        self.socket = str(root / "exec.sock")
        self.process = process
        self.memory_bytes = memory_mb << 20
        self.destroyed = False

    async def set_cores(self, cores: frozenset[int]) -> None:
        """Nothing to do: each command is pinned by the executor to its own cores."""

    async def set_action_cores(self, tag: str, cores: frozenset[int]) -> None:
        """No cgroup here: moving the command's process tree is all there is to a resize, so an executor from an
        older broker (adopted) that cannot do it fails the resize."""
        if not await repin_via_executor(self.socket, tag, cores):
            raise SandboxError("repin_failed", "this environment's executor predates re-pinning (adopted from an "
                                               "older broker): its command cannot change cores")

    async def run(self, request: ExecRequest) -> ExecResult:
        return await self._run(request, None)

    async def stream(self, request: ExecRequest, on_output: OutputSink) -> ExecResult:
        return await self._run(request, on_output)

    async def _run(self, request: ExecRequest, on_output: OutputSink | None) -> ExecResult:
        """The command with the environment's memory as each process's limit: no cgroup holds it here."""
        try:
            answer = await call(self.socket, replace(request, memory_bytes=self.memory_bytes).to_wire(),
                                on_output=on_output)
        except ExecutorUnavailable as error:
            raise SandboxError("environment_lost", f"the environment's executor is gone ({error})",
                               lost=True) from None
        return ExecResult.from_wire(answer, request.output_limit)

    async def exchange(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            return await call(self.socket, request)
        except ExecutorUnavailable as error:
            raise SandboxError("environment_lost", f"the environment's executor is gone ({error})",
                               lost=True) from None

    async def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        await asyncio.to_thread(self._kill_all)
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_all(self) -> None:
        """The executor, and every process a command left behind (they carry the environment's marker)."""
        try:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except psutil.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        except psutil.NoSuchProcess:
            pass
        kill_marked({self.env_id})

    def describe(self) -> dict[str, Any]:
        return {"directory": self.workdir, "executor_pid": self.process.pid}


class LocalProcessBackend(SandboxBackend):
    kind = "local"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    async def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if spec.egress is not None:  # its processes have the host's whole network: an allow-list would be a lie
            raise SandboxError("egress_unsupported", "local processes have this host's network, not a proxy's: "
                                                     "network.mode \"proxy\" needs a Docker node")
        root = self.run_dir / spec.env_id
        workspace = root / "workspace"
        workspace.mkdir(parents=True, mode=0o700)
        for path, data in spec.files.items():
            target = workspace / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (root / LABELS_FILE).write_bytes(orjson.dumps(spec.labels()))
        env = {**os.environ, MARKER: spec.env_id, "PYTHONUNBUFFERED": "1"}
        with (root / "executor.log").open("wb") as log:  # the child keeps its own copy of the descriptor
            process = psutil.Popen([sys.executable, EXECUTOR_PATH, "serve", "--socket", str(root / "exec.sock")],
                                   cwd=workspace, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        sandbox = LocalSandbox(spec.env_id, root, process, spec.memory_mb)
        try:
            await wait_ready(sandbox.socket, READY_TIMEOUT_S)
        except ExecutorUnavailable as error:
            await sandbox.destroy()
            raise SandboxError("sandbox_create_failed", f"local executor never answered: {error}") from None
        return sandbox

    async def adopt(self, broker_id: str) -> list[Leftover]:
        """Executors outlive a killed broker (they run in their own session), so a trajectory environment whose
        executor still answers is adopted as it is."""
        if not self.run_dir.is_dir():
            return []
        leftovers = []
        for root in self.run_dir.iterdir():
            try:  # its commands can write there: no link followed, no FIFO waited on, no file of any size
                labels = orjson.loads(await asyncio.to_thread(read_regular, str(root / LABELS_FILE), MAX_LABELS_BYTES))
                leftover = Leftover.from_labels(labels)
            except (OSError, UntrustedPath, orjson.JSONDecodeError, KeyError, ValueError, TypeError):
                await self._remove(root)  # not a trajectory environment this version made
                continue
            if labels.get(LABEL_EPHEMERAL) == "1":
                await self._remove(root)
                continue
            process = await asyncio.to_thread(_executor_of, root.name)
            try:
                if process is None:
                    raise ExecutorUnavailable(str(root / "exec.sock"), "its executor is gone")
                await wait_ready(str(root / "exec.sock"), ADOPT_TIMEOUT_S)
            except ExecutorUnavailable as error:
                await self._remove(root)
                leftovers.append(leftover.lost(error.reason))
                continue
            leftovers.append(leftover.adopted(LocalSandbox(root.name, root, process, leftover.memory_mb)))
        return leftovers

    async def _remove(self, root: Path) -> None:
        await asyncio.to_thread(kill_marked, {root.name})
        shutil.rmtree(root, ignore_errors=True)

    async def reap(self, broker_id: str) -> int:
        """Kill processes of environments a previous run of this broker left, and remove their directories."""
        if not self.run_dir.is_dir():
            return 0
        leftovers = {p.name for p in self.run_dir.iterdir()}
        await asyncio.to_thread(kill_marked, leftovers)
        for name in leftovers:
            shutil.rmtree(self.run_dir / name, ignore_errors=True)
        return len(leftovers)

    def describe(self) -> dict[str, Any]:
        return {"backend": "local", "isolation": "process (weak)"}
