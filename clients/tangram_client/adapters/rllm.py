"""rLLM's ``Sandbox`` protocol over the broker: one broker environment per rLLM sandbox (one task's rollout).

Read from rllm-org/rllm (``rllm/sandbox/protocol.py``, with ``rllm/sandbox/backends/docker.py`` and ``local.py``,
``rllm/eval/script_evaluator.py``): a synchronous ``exec(command, timeout=None, user=None) -> str`` (stdout; a
non-zero exit raises ``RuntimeError``, which ``rllm.sandbox.protocol._safe_exec`` turns into the tool's answer),
``upload_file(local_path, remote_path)``, ``upload_dir(local_path, remote_path)``, ``close()`` and ``is_alive()``;
a backend is made with ``(name, image, **kwargs)`` and is alive from then on. Tested against that protocol: rllm is
not installable here (no distribution of it on the package index). Pass a ``TangramSandbox`` where rLLM takes a
sandbox (``flow.run(task, config, env=sandbox)``, ``ShellScriptEvaluator(sandbox)``).

Mapping: the constructor makes the environment with an exec of ``true`` (``sandbox_user`` default ``root``, the user
of rLLM's Docker backend's default image); ``exec`` is one exec action in it
(``timeout`` -> ``run_timeout_s``, ``user`` -> ``spec.user``, the sandbox's own user only); a failed command raises
``CommandFailed`` (a ``RuntimeError`` with ``exit_code``, ``stdout``, ``stderr``), and so does a command the broker
could not run; uploads inside the working directory go through ``write_files``, others through one exec (a tar on
its stdin, at most 1 MiB); ``close`` deletes the environment. A refusal of the configuration (401, 403, a 422 on
anything but the command) raises the client's error, which ``_safe_exec`` does not swallow.
"""

from __future__ import annotations

import base64
import io
import posixpath
import shlex
import tarfile
from pathlib import Path
from typing import Any

from tangram_client.errors import TangramError, config_error
from tangram_client.sync_client import TangramClient

WORKDIR = "/workspace"
QUEUE_S = 600.0  # how long a command may wait for cores, beyond its own run time


class CommandFailed(RuntimeError):
    """A command that exited non-zero (``exit_code``), or that the broker could not run (``exit_code`` None)."""

    def __init__(self, message: str, exit_code: int | None = None, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr


class TangramSandbox:
    """``TangramSandbox(name, image=None, broker_url=..., task="rllm")``: rLLM's ``Sandbox`` on a broker. ``client``
    shares one ``TangramClient`` between sandboxes (it stays open at ``close``); ``token`` defaults to
    ``$TANGRAM_TOKEN``; ``sandbox_user``, ``memory_mb`` and ``image`` make the environment (``image``: one the
    broker's nodes have; None: their default)."""

    def __init__(self, name: str, image: str | None = None, *, broker_url: str = "http://127.0.0.1:8300",
                 task: str = "rllm", token: str | None = None, client: TangramClient | None = None,
                 sandbox_user: str | None = "root", memory_mb: int | None = None, cores: int = 1,
                 workdir: str = WORKDIR) -> None:
        self.name, self.cores, self.workdir = name, cores, workdir
        self._owns_client = client is None
        self.client = client or TangramClient(broker_url, task=task, token=token)
        create = {key: value for key, value in (("image", image), ("sandbox_user", sandbox_user),
                                                ("memory_mb", memory_mb)) if value is not None}
        self.environment = ""  # its id once made; "" once closed
        try:
            record = self.client.exec("true", cores=cores, trajectory=name, **create)
        except BaseException:
            self.close()
            raise
        self.environment = str(record.result["environment"])

    def _run(self, command: str, **spec: Any) -> dict[str, Any]:
        """One exec action's result; the broker's failures to run it as ``CommandFailed``."""
        self._inside(".")  # not closed?
        try:
            return self.client.exec(command, cores=self.cores, trajectory=self.name, environment=self.environment,
                                    **spec).result
        except TangramError as error:
            if config_error(error):
                raise
            raise CommandFailed(f"Command could not run in sandbox {self.name}: {command[:200]}: {error}") from error

    def exec(self, command: str, timeout: float | None = None, user: str | None = None, *,
             stdin: bytes | None = None) -> str:
        """The command's stdout; ``CommandFailed`` when it exits non-zero (its stderr's tail in the message).
        ``stdin``: bytes for its standard input (at most the broker's 1 MiB), beyond rLLM's protocol."""
        spec: dict[str, Any] = {} if timeout is None else {"run_timeout_s": timeout, "timeout_s": timeout + QUEUE_S}
        if user is not None:
            spec["user"] = user
        if stdin is not None:
            spec["stdin"] = {"base64": base64.b64encode(stdin).decode()}
        result = self._run(command, **spec)
        stdout, stderr = result.get("stdout") or "", result.get("stderr") or ""
        if result.get("exit_code") != 0:
            code = result.get("exit_code")
            raise CommandFailed(f"Command failed (exit {code}) in sandbox {self.name}: {command[:200]}\n"
                                f"stderr (tail):\n{stderr[-600:]}", code, stdout, stderr)
        return str(stdout)

    def _inside(self, path: str) -> str | None:  # relative to the working directory when it lies there
        if not self.environment:
            raise RuntimeError(f"sandbox {self.name} is closed")
        relative = posixpath.relpath(posixpath.normpath(posixpath.join(self.workdir, path)), self.workdir)
        return None if relative == "." or relative.startswith("..") else relative

    def upload_file(self, local_path: str, remote_path: str) -> None:
        if (inside := self._inside(remote_path)) is not None:
            self.client.write_files(self.environment, {inside: Path(local_path).read_bytes()})
        else:
            self._untar(local_path, posixpath.dirname(remote_path), posixpath.basename(remote_path))

    def upload_dir(self, local_path: str, remote_path: str) -> None:
        source, inside = Path(local_path), self._inside(remote_path)
        if inside is not None:
            self.client.write_files(self.environment, {
                posixpath.join(inside, path.relative_to(source).as_posix()): path.read_bytes()
                for path in sorted(source.rglob("*")) if path.is_file()})
        else:
            self._untar(local_path, remote_path, ".")

    def _untar(self, local_path: str, remote_dir: str, name: str) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(local_path, arcname=name)
        target = shlex.quote(remote_dir or "/")
        self.exec(f"mkdir -p -- {target} && tar -xf - --no-same-owner -C {target}", stdin=buffer.getvalue())

    def is_alive(self) -> bool:
        """Whether the broker still has the environment ready; never raises."""
        try:
            return bool(self.environment) and self.client.get_environment(self.environment).get("state") == "ready"
        except Exception:  # noqa: BLE001 - rLLM's protocol: any error in the check means False
            return False

    def close(self) -> None:
        """Delete the environment (if the broker still has it) and close an own client."""
        try:
            if self.environment:
                environment, self.environment = self.environment, ""
                try:
                    self.client.delete_environment(environment)
                except TangramError:
                    pass  # gone already, or the broker's idle TTL takes it
        finally:
            if self._owns_client:
                self.client.close()
