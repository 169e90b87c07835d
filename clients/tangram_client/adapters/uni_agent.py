"""A uni-agent sandbox provider (``provider: tangram``) whose commands are broker ``exec`` actions in one sandbox.

uni-agent is verl-project/uni-agent (package ``uni_agent``), which is not on PyPI (PyPI's ``uni-agent`` is an
unrelated SDK without sandboxes), so this is written and tested against its protocol as read from its source
(commit 6f4a7c97, 2026-08-07), not against an installed copy. ``uni_agent/sandbox/base.py``: a provider subclasses
``Sandbox`` (l. 149) and implements ``start`` and ``stop`` (l. 173-181) and ``_exec(argv, *, timeout, workdir, env)
-> ExecResult(exit_code, stdout, stderr)`` (l. 38-44, 245-255); the public ``exec`` (l. 257-273) owns the error
policy: a timeout error from ``_exec`` becomes ``exit_code`` -1, another error 127 while ``is_alive()`` (l. 284) says
the sandbox lives, and is re-raised when it does not; ``exec_shell`` is ``bash -c`` over ``exec`` (l. 294-303); file
methods may be overridden (l. 313-329). ``uni_agent/sandbox/registry.py``: ``register_sandbox(name)`` (l. 27) and
``build_sandbox(SandboxConfig)`` -> ``cls.from_config(config)`` (l. 64-66). Tasks run it as ``async with
self.build_sandbox() as sandbox`` (``uni_agent/tasks/swe_bench/task.py`` l. 39; ``__aenter__`` retries ``start``).

Mapping: ``start`` makes the broker environment (its image: ``SandboxConfig.image`` when set explicitly, else the
broker's default), ``stop`` deletes it; ``_exec`` runs ``argv`` in it with ``timeout`` as ``run_timeout_s``,
``workdir`` as ``cwd`` and ``env``; a timed-out action raises ``TimeoutError`` (so -1), another failed action a
``RuntimeError`` (127, or re-raised once the environment is lost). A broker refusal of the configuration (401, 403,
a 422 on anything but the command) makes ``is_alive()`` false, so it raises out of ``exec`` instead of becoming a
result. ``read_file``/``write_file`` use the broker's file API for paths in the work dir and uni-agent's exec-based
floor elsewhere. ``runtime_timeout`` has no broker counterpart (an idle environment goes after ``cpu.idle_ttl_s``).
No native shell (``supports_shell`` stays false): uni-agent's ``stateful_shell`` tool then falls back to tmux over
``exec``, which needs tmux in the image (the broker's default image has none). Import this module to register the
provider, then ``SandboxConfig(provider="tangram", sandbox_kwargs={"broker_url": ..., "task": ...})``; the token is
``token`` or ``$TANGRAM_TOKEN``.
"""

from __future__ import annotations

import uuid

from uni_agent.sandbox.base import ExecResult, Sandbox, SandboxConfig
from uni_agent.sandbox.registry import register_sandbox

from tangram_client import errors
from tangram_client.client import AsyncTangramClient


@register_sandbox("tangram")
class TangramSandbox(Sandbox):
    """One broker environment per episode; see the module's docstring. Keyword arguments are ``sandbox_kwargs``."""

    def __init__(self, *, broker_url: str = "http://127.0.0.1:8300", task: str = "uni-agent",
                 token: str | None = None, image: str | None = None, memory_mb: int | None = None, cores: int = 1,
                 trajectory: str | None = None, queue_timeout_s: float | None = None,
                 output_limit: int | None = None, workdir: str = "/workspace") -> None:
        self.broker_url, self.task, self.token = broker_url, task, token
        self.image, self.memory_mb, self.cores = image, memory_mb, cores
        self.trajectory = trajectory or f"uni-agent-{uuid.uuid4().hex}"
        self.queue_timeout_s, self.output_limit, self.workdir = queue_timeout_s, output_limit, workdir.rstrip("/")
        self.client: AsyncTangramClient | None = None
        self.environment_id: str | None = None
        self.refused: errors.TangramError | None = None  # the configuration error that ended this sandbox

    @classmethod
    def from_config(cls, config: SandboxConfig) -> TangramSandbox:
        image = config.image if "image" in config.model_fields_set else None  # "python:3.12" is uni-agent's default
        return cls(**{"image": image, **config.sandbox_kwargs})

    async def start(self) -> None:
        if self.environment_id is not None:
            return
        self.client = self.client or AsyncTangramClient(self.broker_url, task=self.task, token=self.token)
        made = await self.client.create_environment(trajectory=self.trajectory, image=self.image,
                                                    memory_mb=self.memory_mb)
        self.environment_id = made["id"]

    async def stop(self) -> None:
        """Delete the environment and close the client; safe after a failed or partial start, and twice."""
        environment, self.environment_id = self.environment_id, None
        client, self.client = self.client, None
        if client is None:
            return
        try:
            if environment is not None:
                await client.delete_environment(environment)
        except errors.NotFoundError:
            pass  # already gone (the broker's idle TTL)
        finally:
            await client.close()

    def _live(self) -> tuple[AsyncTangramClient, str]:
        if self.client is None or self.environment_id is None:
            raise RuntimeError("the sandbox is not started (use `async with sandbox:`)")
        return self.client, self.environment_id

    async def _exec(self, argv: list[str], *, timeout: float | None = None, workdir: str | None = None,
                    env: dict[str, str] | None = None) -> ExecResult:
        client, environment = self._live()
        optional = {"run_timeout_s": timeout, "cwd": workdir, "env": env, "output_limit": self.output_limit}
        spec = {"command": list(argv), "environment": environment,
                **{key: value for key, value in optional.items() if value is not None}}
        try:
            record = await client.submit("exec", {"cpu": self.cores}, spec, trajectory=self.trajectory,
                                         timeout_s=self.queue_timeout_s, wait=True)
        except errors.TangramError as error:
            if errors.config_error(error):
                self.refused = error
            raise
        if record.state == "timed_out":
            raise TimeoutError(f"the broker timed the command out: {(record.error or {}).get('message', '')}")
        if not record.succeeded:
            failed = record.error or {}
            raise RuntimeError(f"the command did not finish ({failed.get('code', record.state)}): "
                               f"{failed.get('message', '')}")
        result = record.result
        code = result.get("exit_code")
        if code is None:  # killed by a signal: the shell's convention
            code = 128 + int(result.get("signal") or 0)
        return ExecResult(exit_code=int(code), stdout=result.get("stdout") or "", stderr=result.get("stderr") or "")

    async def is_alive(self) -> bool:
        """False after a configuration refusal, or when the broker says the environment is lost or gone."""
        if self.refused is not None or self.client is None or self.environment_id is None:
            return False
        try:
            return (await self.client.get_environment(self.environment_id)).get("state") in ("pending", "ready")
        except errors.TangramError:
            return False  # uni-agent's rule: a probe never raises

    def _in_workdir(self, path: str) -> str | None:
        """``path`` relative to the work dir where the broker's file API reaches it, else None."""
        if not path.startswith("/"):
            return path
        return path[len(self.workdir) + 1:] if path.startswith(self.workdir + "/") else None

    async def read_file(self, path: str) -> bytes:
        relative = self._in_workdir(path)
        if relative is None:
            return await super().read_file(path)
        client, environment = self._live()
        return await client.read_file(environment, relative)

    async def write_file(self, path: str, content: bytes | str) -> None:
        relative = self._in_workdir(path)
        if relative is None:
            return await super().write_file(path, content)
        client, environment = self._live()
        await client.write_files(environment, {relative: content})
