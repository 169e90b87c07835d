"""slime's agent ``Sandbox`` protocol over the broker: one broker environment per ``async with`` (one rollout).

Read from THUDM/slime (``slime/agent/sandbox.py``: the ``Sandbox`` protocol and its ``E2BSandbox``; called by
``examples/coding_agent_rl/swe.py`` and ``slime/agent/harness/common.py``): ``sandbox_id``, ``async with``,
``exec(cmd, *, user="root", env=None, timeout=120, check=False, idempotent=True) -> (exit_code, stdout, stderr)``
(``check`` raises ``RuntimeError`` on a non-zero exit), ``write_file(sandbox_path, content: str | bytes | Path, *,
user="root")`` and ``read_file(sandbox_path, *, user="root") -> str`` ("" when it cannot be read). Tested against
that protocol: slime is not installable here (the index's ``slime`` is an unrelated package; THUDM's is not on it).

Mapping: entering makes the environment with an exec of ``true`` (``sandbox_user`` default ``root``, slime's default
``user``; a broker sandbox cannot change users, so ``user`` must be the sandbox's own); ``exec`` is one exec action
(``timeout`` -> ``run_timeout_s``; past it ``TimeoutError``, as E2B's client raises; ``idempotent`` needs nothing:
every submit carries an idempotency key, so a retried one never runs twice); files inside the working directory go
through ``write_files``/``read_file``, others through one exec (base64 on its stdin, at most 1 MiB, or its stdout,
at most 16 MiB); leaving deletes the environment. slime's ``exec_and_wait`` detaches with ``setsid ... &``, which
the broker reaps when the launching command ends: call ``exec`` with a long ``timeout`` instead (no stream is held
open: the client long-polls). A refusal of the configuration (401, 403, a 422 on anything but the command) raises.
"""

from __future__ import annotations

import base64
import posixpath
import shlex
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tangram_client.client import AsyncTangramClient
from tangram_client.errors import (
    ActionError,
    TangramError,
    config_error,
)

if TYPE_CHECKING:  # typing.Self is Python 3.11's; the client runs on 3.10
    from typing_extensions import Self

WORKDIR = "/workspace"
READ_LIMIT = 16 << 20  # the broker's largest output_limit
QUEUE_S = 600.0  # how long a command may wait for cores, beyond its own run time
ExecResult = tuple[int, str, str]


class TangramSandbox:
    """``async with TangramSandbox(image=None, broker_url=..., task="slime") as sb``. ``client`` shares one
    ``AsyncTangramClient`` between sandboxes (left open on exit); ``token`` defaults to ``$TANGRAM_TOKEN``;
    ``trajectory`` names the rollout at the broker (default: a fresh one per sandbox)."""

    def __init__(self, image: str | None = None, *, broker_url: str = "http://127.0.0.1:8300", task: str = "slime",
                 token: str | None = None, client: AsyncTangramClient | None = None, trajectory: str | None = None,
                 sandbox_user: str | None = "root", memory_mb: int | None = None, cores: int = 1,
                 workdir: str = WORKDIR) -> None:
        self.cores, self.workdir, self.trajectory = cores, workdir, trajectory or f"slime-{uuid.uuid4().hex}"
        self._owns_client = client is None
        self.client = client or AsyncTangramClient(broker_url, task=task, token=token)
        self.create: dict[str, Any] = {key: value for key, value in (("image", image), ("sandbox_user", sandbox_user),
                                                     ("memory_mb", memory_mb)) if value is not None}
        self.sandbox_id = ""

    async def __aenter__(self) -> Self:
        try:
            record = await self.client.exec("true", cores=self.cores, trajectory=self.trajectory, **self.create)
        except BaseException:
            await self.__aexit__()
            raise
        self.sandbox_id = str(record.result["environment"])
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.sandbox_id:
                sandbox_id, self.sandbox_id = self.sandbox_id, ""
                try:
                    await self.client.delete_environment(sandbox_id)
                except TangramError:
                    pass  # gone already, or the broker's idle TTL takes it
        finally:
            if self._owns_client:
                await self.client.close()

    async def exec(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None, timeout: int = 120,
                   check: bool = False, idempotent: bool = True, stdin: bytes | None = None,
                   output_limit: int | None = None) -> ExecResult:
        """``(exit_code, stdout, stderr)``; ``stdin`` and ``output_limit`` go beyond slime's protocol."""
        self._inside(".")  # entered?
        spec: dict[str, Any] = {"user": user, "run_timeout_s": timeout, "timeout_s": timeout + QUEUE_S}
        if env:
            spec["env"] = env
        if stdin is not None:
            spec["stdin"] = {"base64": base64.b64encode(stdin).decode()}
        if output_limit is not None:
            spec["output_limit"] = output_limit
        try:
            record = await self.client.exec(cmd, cores=self.cores, trajectory=self.trajectory,
                                            environment=self.sandbox_id, **spec)
        except ActionError as error:
            if error.record.state == "timed_out":
                raise TimeoutError(f"command timed out after {timeout} s: {cmd[:120]}") from error
            raise RuntimeError(f"command could not run: {cmd[:120]}: {error}") from error
        result = record.result
        code, stdout, stderr = int(result["exit_code"]), result.get("stdout") or "", result.get("stderr") or ""
        if check and code != 0:
            raise RuntimeError(f"exec failed (exit={code}): {cmd[:120]}\n{stderr[:400]}")
        return code, stdout, stderr

    def _inside(self, path: str) -> str | None:  # relative to the working directory when it lies there
        if not self.sandbox_id:
            raise RuntimeError("enter the sandbox (async with) first")
        relative = posixpath.relpath(posixpath.normpath(posixpath.join(self.workdir, path)), self.workdir)
        return None if relative == "." or relative.startswith("..") else relative

    async def write_file(self, sandbox_path: str, content: str | bytes | Path, *, user: str = "root") -> None:
        data = content.read_bytes() if isinstance(content, Path) else content
        if (inside := self._inside(sandbox_path)) is not None:
            await self.client.write_files(self.sandbox_id, {inside: data})
            return
        target = shlex.quote(sandbox_path)
        await self.exec(f"mkdir -p -- \"$(dirname -- {target})\" && cat > {target}", user=user, check=True,
                        stdin=data.encode() if isinstance(data, str) else data)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text (undecodable bytes replaced); "" when it cannot be read, as slime's E2B sandbox."""
        inside = self._inside(sandbox_path)
        try:
            if inside is not None:
                data = await self.client.read_file(self.sandbox_id, inside)
            else:
                code, stdout, _ = await self.exec(f"base64 -w0 -- {shlex.quote(sandbox_path)}", user=user,
                                                  output_limit=READ_LIMIT)
                data = base64.b64decode(stdout) if code == 0 else b""
        except TangramError as error:
            if config_error(error):
                raise
            return ""
        except (RuntimeError, TimeoutError):
            return ""
        return data.decode(errors="replace")
