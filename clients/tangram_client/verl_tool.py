"""A verl tool that runs a model's shell commands as broker ``exec`` actions, one sandbox per trajectory.

verl's ``ToolAgentLoop`` creates and releases a tool instance around every single call, so the sandbox cannot live
in the instance: every call names the trajectory by verl's per-trajectory ``agent_data.request_id``, and the broker
keeps one sandbox per (task, trajectory), made on the trajectory's first ``exec`` and reused after it. ``release``
(per call) therefore leaves the sandbox alone. The sandbox goes when the trajectory ends:

* with the ``tangram_tool_agent`` loop (``tangram_client/verl_agent_loop.py``), which runs each trajectory inside
  ``trajectory_scope()`` and deletes the environments of its trajectories when ``run`` returns or raises;
* from a custom loop, by ``await tool.release_trajectory(request_id)`` or by running it inside
  ``trajectory_scope()`` too;
* otherwise by the broker's ``cpu.idle_ttl_s``, which destroys an environment idle that long (the backstop when a
  rollout worker dies before its cleanup runs).

Point verl at it with ``actor_rollout_ref.rollout.multi_turn.tool_config_path=`` the path of the package's
``verl_tool_config.yaml`` (``python -m tangram_client.verl_paths`` prints it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from tangram_client.client import AsyncTangramClient
from tangram_client.errors import (
    NotFoundError,
    TangramError,
    config_error,
)
from tangram_client.records import ActionRecord

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8300"

#: keys of the tool's ``config:`` in verl's tool YAML (``type`` is verl's own: ``native``)
CONFIG_KEYS = frozenset({"type", "broker_url", "task", "cores", "elasticity", "memory_mb", "image", "timeout_s",
                         "output_limit", "pytest_parallel", "signature", "retries", "run_timeout_s", "token"})
#: keys of a sample's ``tools_kwargs.<tool>.create_kwargs``
CREATE_KEYS = frozenset({"files"})

DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command in your sandbox, a Linux container with python3. Files and the working "
                       "directory (/workspace) persist between your commands; the network is off.",
        "parameters": {"type": "object",
                       "properties": {"command": {"type": "string", "description": "the shell command to run"}},
                       "required": ["command"]},
    },
}


def core_range(value: Any, where: str) -> tuple[int, int]:
    """``cores`` as ``(min, max)`` from ``2``, ``[1, 8]`` or ``{"min": 1, "max": 8}`` (YAML or OmegaConf)."""
    if isinstance(value, bool):
        raise TypeError(f"{where}: must be a core count, [min, max] or {{min, max}}, not a bool")
    if isinstance(value, int):
        low = high = value
    elif isinstance(value, Mapping) or hasattr(value, "keys"):
        unknown = sorted(set(value.keys()) - {"min", "max"})
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key (use min and max)")
        low, high = value.get("min", 1), value.get("max", value.get("min", 1))
    elif not isinstance(value, str) and hasattr(value, "__len__") and len(value) == 2:
        low, high = value[0], value[1]
    else:
        raise ValueError(f"{where}: must be a core count, [min, max] or {{min, max}}, got {value!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (low, high)) or low > high:
        raise ValueError(f"{where}: needs whole numbers 1 <= min <= max, got {value!r}")
    return low, high


class LoopClients:
    """One ``AsyncTangramClient`` per running event loop: an aiohttp session belongs to the loop that made it, and
    verl may call one tool object from several loops (threads, Ray actors with their own loops). A client whose
    loop has closed is dropped the next time another loop asks."""

    def __init__(self, base_url: str, task: str, retries: int, token: str | None = None) -> None:
        self.base_url, self.task, self.retries, self.token = base_url, task, retries, token
        self._clients: dict[asyncio.AbstractEventLoop, AsyncTangramClient] = {}
        self._lock = threading.Lock()

    def current(self) -> AsyncTangramClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            if client is None:
                for stale in [other for other in self._clients if other.is_closed()]:
                    del self._clients[stale]
                client = self._clients[loop] = AsyncTangramClient(self.base_url, task=self.task,
                                                                  retries=self.retries, token=self.token)
            return client

    async def close(self) -> None:
        """Close this loop's client (other loops close theirs)."""
        with self._lock:
            client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()


class TrajectoryScope:
    """The trajectories that ran commands while the scope was active, with the tool that knows their sandbox."""

    def __init__(self) -> None:
        self._members: dict[tuple[int, str], tuple[BrokerShellTool, str]] = {}

    def add(self, tool: BrokerShellTool, trajectory: str) -> None:
        self._members[(id(tool), trajectory)] = (tool, trajectory)

    async def release(self) -> None:
        members, self._members = list(self._members.values()), {}
        await asyncio.gather(*(tool.release_trajectory(trajectory) for tool, trajectory in members))


_SCOPE: ContextVar[TrajectoryScope | None] = ContextVar("tangram_trajectory_scope", default=None)


@asynccontextmanager
async def trajectory_scope() -> AsyncIterator[TrajectoryScope]:
    """Run trajectories inside this block; their sandboxes are deleted when it ends, however it ends. Tool calls
    made in tasks spawned inside the block (verl gathers parallel calls) see the scope through the context."""
    scope = TrajectoryScope()
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
        await scope.release()


def format_output(result: Mapping[str, Any]) -> str:
    """An exec result (or the partial output kept in a failure) as text a model reads."""
    if result.get("signal") is not None:
        lines = [f"killed by signal {result['signal']}"]
    elif result.get("exit_code") is not None:
        lines = [f"exit code: {result['exit_code']}"]
    else:
        lines = []
    for stream in ("stdout", "stderr"):
        text = result.get(stream) or ""
        if text:
            lines.append(f"{stream}:\n{text.rstrip()}")
        if result.get(f"{stream}_truncated"):
            lines.append(f"[{stream} truncated; {result.get(f'{stream}_bytes')} bytes in all]")
    if len(lines) == 1 and result.get("exit_code") is not None:
        lines.append("(no output)")
    return "\n".join(lines)


class BrokerShellTool(BaseTool):
    """verl ``BaseTool`` whose calls are broker ``exec`` actions in the trajectory's sandbox.

    ``config`` (the YAML ``config:``): ``broker_url``, ``task`` (the RL task's name at the broker), ``cores`` (a
    count, ``[min, max]`` or ``{min, max}``; default 1), ``elasticity`` (the action's elasticity object, e.g.
    ``{resource: cpu, efficiency: {"1": 1.0, "4": 0.8}}``), ``memory_mb`` and ``image`` (the sandbox's, first action
    only), ``timeout_s`` (per command, queueing included), ``run_timeout_s`` (per command, its own run only: a
    command that waited in the queue is not cut short for it), ``output_limit`` (bytes per stream), ``pytest_parallel``
    (rewrite ``pytest`` to ``pytest -n N``), ``signature`` (the learned-duration key; default the tool's name),
    ``retries`` (client retries on connection errors and 429/503) and ``token`` (a broker with auth; default
    ``$TANGRAM_TOKEN``).

    A sample's ``tools_kwargs.<name>.create_kwargs.files`` (path -> text, or ``{"base64": ...}``) is copied into
    ``/workspace`` by the trajectory's first command. Broker errors that a command can cause (a queue deadline, a
    command too long) are the tool's answer for the model to read, and logged; those that say the tool is
    misconfigured raise, since every later call would fail alike and train on them: 401 and 403 (a token missing,
    unknown or not this task's) and 422 on anything but the command (``config_error``).
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        unknown = sorted(set(config) - CONFIG_KEYS)
        if unknown:
            raise ValueError(f"{type(self).__name__} config: unknown key {unknown[0]!r} "
                             f"(known: {', '.join(sorted(CONFIG_KEYS))})")
        self.cores = core_range(config.get("cores", 1), "config.cores")
        task = config.get("task")
        if not isinstance(task, str) or not task:
            raise ValueError(f"{type(self).__name__} config: task must name the RL task at the broker")
        for key, kind in (("timeout_s", (int, float)), ("run_timeout_s", (int, float)), ("memory_mb", int),
                          ("output_limit", int), ("retries", int)):
            value = config.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind) or value < 0):
                raise ValueError(f"{type(self).__name__} config: {key} must be a non-negative number, got {value!r}")
        self.elasticity = dict(config["elasticity"]) if config.get("elasticity") else None
        self.timeout_s: float | None = config.get("timeout_s")
        self.sandbox_spec = {key: config[key] for key in ("memory_mb", "image") if config.get(key) is not None}
        self.command_spec = {key: config[key] for key in ("output_limit", "pytest_parallel", "run_timeout_s")
                             if config.get(key) is not None}
        token = config.get("token")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError(f"{type(self).__name__} config: token must be the broker's bearer token (a string)")
        self.clients = LoopClients(str(config.get("broker_url") or DEFAULT_URL), task, int(config.get("retries", 3)),
                                   token)
        # verl's BaseTool takes None (it falls back to get_openai_tool_schema), though its annotation says otherwise
        super().__init__(config, tool_schema)  # type: ignore[arg-type]
        self.signature = str(config.get("signature") or self.name)
        self._files: dict[str, dict[str, Any]] = {}  # instance id -> files its trajectory starts with
        self._environments: dict[str, str] = {}  # trajectory (verl request id) -> broker environment id

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The YAML's ``tool_schema``, or when it gives none, a ``shell`` function of one ``command`` string."""
        return getattr(self, "tool_schema", None) or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA)

    def environment_of(self, trajectory: str) -> str | None:
        """The broker environment this tool's commands of ``trajectory`` ran in, if any."""
        return self._environments.get(trajectory)

    async def create(self, instance_id: str | None = None, create_kwargs: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        create_kwargs = create_kwargs or {}
        unknown = sorted(set(create_kwargs) - CREATE_KEYS)
        if unknown:
            raise ValueError(f"create_kwargs: unknown key {unknown[0]!r} (known: {', '.join(sorted(CREATE_KEYS))})")
        instance_id = instance_id or uuid.uuid4().hex
        self._files[instance_id] = dict(create_kwargs.get("files") or {})
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run ``parameters["command"]``. Without ``agent_data`` (a caller outside verl's agent loop) the command
        gets a sandbox of its own, removed when it ends."""
        command = parameters.get("command")
        if not isinstance(command, str) or not command.strip():
            return ToolResponse(text="Error: the `command` argument must be a non-empty string."), 0.0, {}
        trajectory = getattr(kwargs.get("agent_data"), "request_id", None)
        spec: dict[str, Any] = {"command": command, **self.command_spec}
        if trajectory is None or trajectory not in self._environments:
            # the sandbox is made by this command: send what it starts with (not again with each call: the broker
            # would write them over what the trajectory's commands made of them)
            spec.update(self.sandbox_spec)
            files = self._files.get(instance_id)
            if files:
                spec["files"] = files
        try:
            record = await self.clients.current().submit(
                "exec", {"cpu": self.cores}, spec, trajectory=trajectory, elasticity=self.elasticity,
                timeout_s=self.timeout_s, signature=self.signature, wait=True)
        except TangramError as error:
            if config_error(error):
                log.error("%s: the broker refuses this tool's commands (its config): %s", self.name, error)
                raise
            log.warning("%s: the broker did not run a command of trajectory %s: %s", self.name, trajectory, error)
            return ToolResponse(text=f"Error: the command could not be run: {error}"), 0.0, {"broker_error": 1}
        environment = (record.result or record.error or {}).get("environment")
        previous = self._environments.get(trajectory) if trajectory is not None else None
        if trajectory is not None and environment is not None:
            self._environments[trajectory] = environment
            scope = _SCOPE.get()
            if scope is not None:
                scope.add(self, trajectory)
        text = await self._answer(record, trajectory)
        if previous is not None and environment is not None and environment != previous:
            text += "\n(Your sandbox had been idle too long and was made afresh: earlier files are gone.)"
        return ToolResponse(text=text), 0.0, self._metrics(record)

    async def _answer(self, record: ActionRecord, trajectory: str | None) -> str:
        if record.succeeded:
            return format_output(record.result)
        error = record.error or {}
        code, message = error.get("code", record.state), error.get("message", "")
        log.warning("%s: command of trajectory %s ended %s: %s: %s", self.name, trajectory, record.state, code,
                    message)
        text = f"Error: the command did not finish ({code}): {message}"
        if code == "environment_lost" and trajectory is not None:
            # the broker keeps a lost sandbox until it is deleted; delete it so the next command starts afresh
            await self.release_trajectory(trajectory)
            text += "\nThe sandbox was lost; your next command runs in a fresh one (earlier files are gone)."
        partial = format_output(error)
        return f"{text}\n{partial}" if partial else text

    @staticmethod
    def _metrics(record: ActionRecord) -> dict[str, Any]:
        timings = record.timings
        cores = (record.result or record.error or {}).get("cores") or []
        return {"queue_s": timings.get("queue_s"), "execution_s": timings.get("execution_s"),
                "act_s": timings.get("act_s"), "cores": len(cores)}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """End of one call: forget the call's files. The trajectory's sandbox stays for its next call."""
        self._files.pop(instance_id, None)

    async def write_files(self, trajectory: str, files: Mapping[str, str | bytes]) -> dict[str, Any]:
        """Write files into the sandbox of ``trajectory`` (verl's ``request_id``) between its commands, e.g. a test
        suite for a reward; ``LookupError`` when none of its commands has made one yet."""
        return await self.clients.current().write_files(self._environment(trajectory), files)

    async def read_file(self, trajectory: str, path: str) -> bytes:
        """A file (or a tar of a directory) from the sandbox of ``trajectory``, e.g. what a reward scores."""
        return await self.clients.current().read_file(self._environment(trajectory), path)

    def _environment(self, trajectory: str) -> str:
        environment = self._environments.get(trajectory)
        if environment is None:
            raise LookupError(f"trajectory {trajectory!r} has no sandbox from this tool yet")
        return environment

    async def release_trajectory(self, trajectory: str) -> bool:
        """Delete the sandbox of a finished trajectory (verl's ``request_id``); True when there was one. Failures
        are logged, not raised: the broker's ``cpu.idle_ttl_s`` destroys a sandbox that was left behind."""
        environment = self._environments.pop(trajectory, None)
        if environment is None:
            return False
        try:
            await self.clients.current().delete_environment(environment)
        except NotFoundError:
            pass  # already gone (idle TTL, or deleted by someone else)
        except TangramError as error:
            log.warning("%s: could not delete environment %s of trajectory %s (the broker's idle TTL will): %s",
                        self.name, environment, trajectory, error)
        return True

    async def aclose(self) -> None:
        """Close this event loop's broker client."""
        await self.clients.close()
