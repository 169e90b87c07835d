"""Harbor's environment protocol over the broker: one broker environment per Harbor environment (trial).

Read from harbor 0.26.0 (PyPI; laude-institute/harbor, ``harbor/environments/base.py``): ``BaseEnvironment``'s
abstract ``type()``, ``_validate_definition()`` and async ``start(force_build)``, ``stop(delete)``, ``upload_file``,
``upload_dir``, ``download_file``, ``download_dir``, ``exec(command, cwd, env, timeout_sec, user) -> ExecResult(stdout,
stderr, return_code)``; its Docker environment raises ``RuntimeError`` past ``timeout_sec`` or for a failed copy.
Where harbor imports (Python >= 3.12) this subclasses it (``--environment-import-path tangram_client.adapters.harbor:
TangramEnvironment --ek broker_url=... --ek task=...``; image: the task's ``docker_image`` unless ``image``); elsewhere
it is a class with those methods. ``start`` makes the environment by an exec of ``true`` (``sandbox_user`` default
``root``, as Harbor's verifier runs as root); ``exec`` is one exec action (``timeout_sec`` -> ``run_timeout_s``,
``user`` -> ``spec.user``: the sandbox's own user only); paths in the working directory go through ``write_files`` and
``read_file``, others through an exec (a tar on stdin, at most 1 MiB; base64 on stdout, at most 16 MiB); ``stop``
deletes the environment. A refusal of the configuration (401, 403, 422) raises the client's error.
"""

from __future__ import annotations

import base64
import io
import posixpath
import shlex
import tarfile
from collections import namedtuple
from pathlib import Path
from typing import Any

from tangram_client.client import AsyncTangramClient
from tangram_client.errors import ActionError

WORKDIR = "/workspace"
READ_LIMIT = 16 << 20  # the broker's largest output_limit
QUEUE_S = 600.0  # how long a command may wait for cores, beyond its own run time
ExecResult = namedtuple("ExecResult", "stdout stderr return_code")  # Harbor's, where harbor is not installed

try:  # harbor needs Python >= 3.12
    from harbor.environments.base import BaseEnvironment as _Base
    from harbor.environments.base import ExecResult as _Result
except ImportError:
    _Base, _Result = object, ExecResult


class TangramEnvironment(_Base):  # type: ignore[misc, valid-type]
    def __init__(self, *, session_id: str, broker_url: str = "http://127.0.0.1:8300", task: str = "harbor",
                 token: str | None = None, image: str | None = None, sandbox_user: str | None = "root",
                 memory_mb: int | None = None, cores: int = 1, workdir: str = WORKDIR, **harbor: Any) -> None:
        if _Base is not object:
            super().__init__(session_id=session_id, **harbor)
            image = image or getattr(self.task_env_config, "docker_image", None)
        self.session_id, self.workdir, self.cores = session_id, workdir, cores
        self.default_user: str | int | None = getattr(self, "default_user", None)
        self.create: dict[str, Any] = {key: value for key, value in (
            ("image", image), ("sandbox_user", sandbox_user), ("memory_mb", memory_mb)) if value is not None}
        self.client = AsyncTangramClient(broker_url, task=task, token=token)
        self.environment = ""  # its id once started

    @staticmethod
    def type() -> str:
        return "tangram"

    def _validate_definition(self) -> None:
        """Nothing to check: the broker's nodes have the images."""

    async def start(self, force_build: bool = False) -> None:
        record = await self.client.exec("true", cores=self.cores, trajectory=self.session_id, **self.create)
        self.environment = str(record.result["environment"])

    async def stop(self, delete: bool = True) -> None:
        """Delete the environment (``delete=False`` leaves it to the broker's idle TTL) and close the session."""
        try:
            if delete and self.environment:
                await self.client.delete_environment(self.environment)
        finally:
            self.environment = "" if delete else self.environment
            await self.client.close()

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None, *, stdin: bytes | None = None,
                   output_limit: int | None = None) -> Any:
        """One exec action; a command past ``timeout_sec`` (or lost with its sandbox) raises ``RuntimeError``.
        ``stdin`` (bytes, at most 1 MiB) and ``output_limit`` (bytes per stream) go beyond Harbor's protocol."""
        self._inside(".")  # started?
        user = user if user is not None else self.default_user
        spec: dict[str, Any] = {key: value for key, value in (("cwd", cwd), ("env", env), ("user", user),
                                                              ("output_limit", output_limit)) if value is not None}
        if stdin is not None:
            spec["stdin"] = {"base64": base64.b64encode(stdin).decode()}
        if timeout_sec is not None:
            spec.update(run_timeout_s=timeout_sec, timeout_s=timeout_sec + QUEUE_S)
        try:
            record = await self.client.exec(command, cores=self.cores, trajectory=self.session_id,
                                            environment=self.environment, **spec)
        except ActionError as error:
            if error.record.state == "timed_out":
                raise RuntimeError(f"Command timed out after {timeout_sec} seconds: {error.message}") from error
            raise RuntimeError(f"Command could not run: {error}") from error
        result = record.result
        return _Result(stdout=result.get("stdout"), stderr=result.get("stderr"), return_code=result["exit_code"])

    def _inside(self, path: str) -> str | None:  # relative to the working directory when it lies there
        if not self.environment:
            raise RuntimeError("start() the environment first")
        relative = posixpath.relpath(posixpath.normpath(posixpath.join(self.workdir, path)), self.workdir)
        return None if relative == "." or relative.startswith("..") else relative

    async def _checked(self, command: str, **spec: Any) -> str:
        result = await self.exec(command, **spec)
        if result.return_code != 0:
            raise RuntimeError(f"{command[:200]}: exit code {result.return_code}: {result.stderr}")
        return str(result.stdout or "")

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        if (inside := self._inside(target_path)) is not None:
            await self.client.write_files(self.environment, {inside: Path(source_path).read_bytes()})
        else:
            await self._untar(source_path, posixpath.dirname(target_path), posixpath.basename(target_path))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        source, inside = Path(source_dir), self._inside(target_dir)
        if inside is not None:
            await self.client.write_files(self.environment, {
                posixpath.join(inside, path.relative_to(source).as_posix()): path.read_bytes()
                for path in sorted(source.rglob("*")) if path.is_file()})
        else:
            await self._untar(source, target_dir, ".")

    async def _untar(self, local: Path | str, remote_dir: str, name: str) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(local, arcname=name)
        target = shlex.quote(remote_dir or "/")
        await self._checked(f"mkdir -p -- {target} && tar -xf - --no-same-owner -C {target}", stdin=buffer.getvalue())

    async def _read(self, path: str, command: str) -> bytes:
        if (inside := self._inside(path)) is not None:
            return await self.client.read_file(self.environment, inside)
        return base64.b64decode(await self._checked(command, output_limit=READ_LIMIT))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._read(source_path, f"base64 -w0 -- {shlex.quote(source_path)}")
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        Path(target_path).write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """The directory's files into ``target_dir``, overwriting; links and paths leaving it are refused."""
        quoted = shlex.quote(source_dir)
        data = await self._read(source_dir, f"test -d {quoted} && tar -cf - -C {quoted} . | base64 -w0")
        Path(target_dir).mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(target_dir, filter="data")

