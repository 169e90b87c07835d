"""uni-agent's sandbox plugin interface driven the way uni-agent drives it, over
``tangram_client.adapters.uni_agent.TangramSandbox`` and a real broker with Docker sandboxes and auth: an episode
(``build_sandbox`` from a ``SandboxConfig``, ``async with``, commands, files written and read in and outside the work
dir, a failing then passing pytest run, a reward as ``compute_reward`` makes one, a timeout), the sandbox deleted at
the end, and configuration errors that raise while a refused command stays a result.

uni-agent (verl-project/uni-agent, package ``uni_agent``) is not on PyPI, so where it is not installed the test puts
a stand-in for ``uni_agent.sandbox`` in its place: the parts the adapter builds on, as read from its source (commit
6f4a7c97): ``ExecResult`` and ``SandboxConfig`` (``base.py`` l. 38-67), ``Sandbox``'s lifecycle (l. 163-242: start
retried by ``__aenter__``, stopped after a failed start and at exit), its ``exec`` error policy (l. 257-292),
``exec_shell`` (l. 294-303) and exec-based file floor (l. 313-329), and the registry (``registry.py`` l. 15-66). With
uni-agent installed (or its source on ``PYTHONPATH``) the same test runs against the real classes."""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
import dataclasses
import shlex
import sys
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Self

import pytest
from pydantic import BaseModel, ConfigDict, Field

from tangram_client.errors import ForbiddenError, UnauthorizedError, UnprocessableError
from tests.adapter_brokers import OTHER, TESTS, TOKEN, secured_docker_node
from tests.harness import live_broker

pytestmark = pytest.mark.slow


def install_standin() -> None:
    """``uni_agent.sandbox`` (``base``, ``registry``) as uni-agent's source has it, for where it is not installed."""

    @dataclasses.dataclass
    class ExecResult:
        exit_code: int
        stdout: str
        stderr: str

    class SandboxConfig(BaseModel):
        provider: str
        runtime_timeout: float = 3600.0
        image: str = "python:3.12"
        sandbox_kwargs: dict[str, Any] = Field(default_factory=dict)
        model_config = ConfigDict(extra="forbid")

    class Sandbox(abc.ABC):
        provider: ClassVar[str] = ""

        @classmethod
        def from_config(cls, config: SandboxConfig) -> Sandbox:
            return cls()

        @abc.abstractmethod
        async def start(self) -> None: ...

        @abc.abstractmethod
        async def stop(self) -> None: ...

        async def __aenter__(self, retry: int = 3) -> Self:
            last: Exception | None = None
            for attempt in range(1, max(1, retry) + 1):
                try:
                    await self.start()
                    return self
                except Exception as exc:  # noqa: BLE001  (uni-agent retries any failed start)
                    last = exc
                    with contextlib.suppress(Exception):
                        await self.stop()
                if attempt < retry:
                    await asyncio.sleep(2 * attempt)
            assert last is not None
            raise last

        async def __aexit__(self, *exc: object) -> None:
            await self.stop()

        @asynccontextmanager
        async def entered(self, **start_kwargs: Any) -> AsyncIterator[Sandbox]:
            await self.__aenter__(**start_kwargs)
            try:
                yield self
            finally:
                await self.stop()

        @abc.abstractmethod
        async def _exec(self, argv: list[str], *, timeout: float | None = None, workdir: str | None = None,
                        env: dict[str, str] | None = None) -> ExecResult: ...

        async def exec(self, argv: list[str], *, timeout: float | None = None, workdir: str | None = None,
                       env: dict[str, str] | None = None) -> ExecResult:
            try:
                return await self._exec(argv, timeout=timeout, workdir=workdir, env=env)
            except Exception as exc:
                if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                    return ExecResult(exit_code=-1, stdout="", stderr=f"exec timed out after {timeout}s: {exc}")
                if not await self.is_alive():
                    raise
                return ExecResult(exit_code=127, stdout="", stderr=str(exc))

        async def is_alive(self) -> bool:
            return True

        async def exec_shell(self, script: str, *, timeout: float | None = None, workdir: str | None = None,
                             env: dict[str, str] | None = None) -> ExecResult:
            return await self.exec(["bash", "-c", script], timeout=timeout, workdir=workdir, env=env)

        async def read_file(self, path: str) -> bytes:
            res = await self.exec(["base64", path])
            if res.exit_code != 0:
                raise RuntimeError(f"read_file {path!r} failed: {res.stderr.strip()}")
            return base64.b64decode(res.stdout)

        async def write_file(self, path: str, content: bytes | str) -> None:
            data = content.encode("utf-8") if isinstance(content, str) else content
            quoted, b64 = shlex.quote(path), base64.b64encode(data).decode("ascii")
            res = await self.exec_shell(f'mkdir -p "$(dirname {quoted})" && printf %s {shlex.quote(b64)} | '
                                        f'base64 -d > {quoted}')
            if res.exit_code != 0:
                raise RuntimeError(f"write_file {path!r} failed: {res.stderr.strip()}")

    registry_of: dict[str, type[Sandbox]] = {}

    def register_sandbox(name: str) -> Any:
        def decorator(cls: type[Sandbox]) -> type[Sandbox]:
            cls.provider = name
            registry_of[name] = cls
            return cls
        return decorator

    def build_sandbox(config: SandboxConfig) -> Sandbox:
        return registry_of[config.provider].from_config(config)

    modules = {name: types.ModuleType(name) for name in
               ("uni_agent", "uni_agent.sandbox", "uni_agent.sandbox.base", "uni_agent.sandbox.registry")}
    modules["uni_agent"].__path__ = []
    modules["uni_agent.sandbox"].__path__ = []
    modules["uni_agent.sandbox.base"].__dict__.update(ExecResult=ExecResult, SandboxConfig=SandboxConfig,
                                                      Sandbox=Sandbox)
    modules["uni_agent.sandbox.registry"].__dict__.update(SANDBOX_REGISTRY=registry_of,
                                                          register_sandbox=register_sandbox,
                                                          build_sandbox=build_sandbox)
    modules["uni_agent.sandbox"].__dict__.update(ExecResult=ExecResult, SandboxConfig=SandboxConfig, Sandbox=Sandbox,
                                                 build_sandbox=build_sandbox)
    sys.modules.update(modules)


try:
    import uni_agent.sandbox  # noqa: F401  (the real framework, where installed)
except ImportError:
    install_standin()

from uni_agent.sandbox import SandboxConfig, build_sandbox

from tangram_client.adapters.uni_agent import TangramSandbox

TASK = "uni-agent"
BUGGY = "def add(a, b):\n    return a - b\n"


def sandbox_config(url: str, **sandbox_kwargs: Any) -> Any:
    return SandboxConfig(provider="tangram", sandbox_kwargs={"broker_url": url, "task": TASK, **sandbox_kwargs})


@pytest.fixture
def db(tmp_path: Any) -> str:
    return str(tmp_path / "tangram.db")


async def test_an_episode_runs_in_one_sandbox_and_is_scored_from_its_result(db, monkeypatch):
    async with live_broker(secured_docker_node(TASK), db) as live:
        monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)  # the sandbox's client reads it, as the client does
        sandbox = build_sandbox(sandbox_config(live.url))
        assert isinstance(sandbox, TangramSandbox)
        async with sandbox:  # as uni_agent/tasks/swe_bench/task.py runs an episode
            environment = sandbox.environment_id
            hello = await sandbox.exec_shell("python3 --version; echo to-stderr >&2; pwd; echo $GREETING",
                                             env={"GREETING": "hi"})
            await sandbox.write_file("solution.py", BUGGY)  # in the work dir: the broker's file API
            await sandbox.write_file("/tmp/tests/test_solution.py", TESTS)  # elsewhere: uni-agent's exec floor
            read_back = (await sandbox.read_file("/workspace/solution.py"),
                         await sandbox.read_file("/tmp/tests/test_solution.py"))
            failing = await sandbox.exec(["python3", "-m", "pytest", "-q", "/tmp/tests/test_solution.py"],
                                         workdir="/workspace")
            await sandbox.exec(["sed", "-i", "s/a - b/a + b/", "solution.py"])
            # the reward as swe_bench's compute_reward makes it: a script written, then run with 2>&1 and a timeout
            await sandbox.write_file("/tmp/eval.sh", "python3 -m pytest -q /tmp/tests/test_solution.py\n")
            verdict = await sandbox.exec_shell("bash /tmp/eval.sh 2>&1", workdir="/workspace", timeout=60)
            reward = float(verdict.exit_code == 0)
            timed_out = await sandbox.exec(["sleep", "20"], timeout=1)
            assert sandbox.client is not None
            listed = [env["id"] for env in await sandbox.client.environments()]
        assert hello.exit_code == 0 and hello.stderr == "to-stderr\n"
        assert "Python 3." in hello.stdout and "/workspace\nhi\n" in hello.stdout
        assert read_back == (BUGGY.encode(), TESTS.encode())
        assert failing.exit_code == 1 and "1 failed" in failing.stdout
        assert reward == 1.0 and "1 passed" in verdict.stdout
        assert timed_out.exit_code == -1 and "timed out" in timed_out.stderr
        assert listed == [environment]  # one sandbox for the episode
        assert sandbox.environment_id is None and sandbox.client is None
        status, _ = await live.call("GET", f"/v1/environments/{environment}",
                                    headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 404  # stop() deleted it


async def test_configuration_errors_raise_and_a_refused_command_is_a_result(db, monkeypatch):
    async with live_broker(secured_docker_node(TASK), db) as live:
        monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
        with pytest.raises(UnauthorizedError):
            async with build_sandbox(sandbox_config(live.url)).entered(retry=1):
                pass
        with pytest.raises(ForbiddenError):
            async with build_sandbox(sandbox_config(live.url, token=OTHER)).entered(retry=1):
                pass
        sandbox = build_sandbox(sandbox_config(live.url, token=TOKEN))
        async with sandbox:
            refused = await sandbox.exec(["ls"], workdir="relative/dir")  # one command's 400: uni-agent's 127
            alive = await sandbox.exec_shell("echo still here")
            assert isinstance(sandbox, TangramSandbox)
            sandbox.cores = 64  # more than any node has: every later command would be refused alike
            with pytest.raises(UnprocessableError) as too_big:
                await sandbox.exec(["true"])
            assert not await sandbox.is_alive()
        assert refused.exit_code == 127 and "spec.cwd" in refused.stderr
        assert (alive.exit_code, alive.stdout) == (0, "still here\n")
        assert too_big.value.field == "demand.cpu"
