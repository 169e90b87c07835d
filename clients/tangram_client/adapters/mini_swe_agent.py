"""A mini-swe-agent environment whose commands are broker ``exec`` actions in one sandbox per agent run.

Written against mini-swe-agent 2.4.6 (``pip install mini-swe-agent``). Its ``Environment`` protocol
(``minisweagent/__init__.py``) is ``config``, ``execute(action, cwd="", *, timeout=None) -> dict``,
``get_template_vars(**kwargs)`` and ``serialize()``; its own environments (``environments/docker.py``) answer
``{"output", "returncode", "exception_info"}`` with stderr merged into stdout, ``returncode`` -1 and the partial
output when a command could not finish (its timeout), and raise ``Submitted`` when the output's first line is
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``. ``TangramEnvironment`` does the same over the broker: the sandbox is made
with the environment (``create_environment``, a trajectory of its own) and every ``execute`` runs in it, as ``bash -c``
with ``2>&1`` (``interpreter``) so the two streams arrive interleaved; its ``timeout`` (else ``config.timeout``) is
the command's ``run_timeout_s`` (queueing is bounded by ``queue_timeout_s``). A refusal that says the environment is
misconfigured (401, 403, a 422 on anything but the command) raises out of ``DefaultAgent.run``; other broker errors
are the step's observation with ``returncode`` -1. ``write_files``/``read_file`` reach the sandbox between steps (a
test suite in, a patch out); ``close()`` deletes it. mini's YAML names it as ``environment: {environment_class:
tangram_client.adapters.mini_swe_agent.TangramEnvironment, broker_url: ..., task: ...}``; token: ``token=`` or
``$TANGRAM_TOKEN``.
"""

from __future__ import annotations

import dataclasses
import platform
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge

from tangram_client import errors
from tangram_client.sync_client import TangramClient

if TYPE_CHECKING:  # typing.Self is Python 3.11's; the client runs on 3.10
    from typing_extensions import Self


def merged(result: Mapping[str, Any]) -> str:  # the streams are merged by 2>&1 already; stderr is the shell's own
    return (result.get("stdout") or "") + (result.get("stderr") or "")


def failure(error: errors.TangramError, partial: Mapping[str, Any], what: str) -> dict[str, Any]:
    """A step's answer when the broker did not run the command to its end, shaped as mini's own environments'."""
    return {"output": merged(partial), "returncode": -1, "exception_info": f"The command {what}: {error}",
            "extra": {"exception_type": type(error).__name__, "exception": str(error)}}


@dataclasses.dataclass
class TangramEnvironmentConfig:
    broker_url: str = "http://127.0.0.1:8300"
    task: str = "mini-swe-agent"
    token: str | None = None
    cwd: str = ""  # "" is the sandbox's work dir (/workspace)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    timeout: int = 30  # seconds a command may run (run_timeout_s)
    queue_timeout_s: float | None = None  # deadline from submission, queueing included
    cores: int = 1
    image: str | None = None
    memory_mb: int | None = None
    output_limit: int | None = None  # bytes per stream
    interpreter: list[str] = dataclasses.field(default_factory=lambda: ["bash", "-c"])
    trajectory: str = ""  # "" -> a fresh one per environment


class TangramEnvironment:
    """mini-swe-agent ``Environment`` over one broker sandbox; see the module's docstring."""

    def __init__(self, *, config_class: type = TangramEnvironmentConfig, client: TangramClient | None = None,
                 **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        self.trajectory = self.config.trajectory or f"mini-swe-agent-{uuid.uuid4().hex}"
        self._own_client = client is None  # a client passed in is the caller's to close
        self.client = client or TangramClient(self.config.broker_url, task=self.config.task, token=self.config.token)
        try:
            made = self.client.create_environment(trajectory=self.trajectory, image=self.config.image,
                                                  memory_mb=self.config.memory_mb)
        except BaseException:
            self.close()
            raise
        self.environment_id: str | None = made["id"]

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"environment": self._environment(), "run_timeout_s": timeout or self.config.timeout}
        optional = {"cwd": cwd or self.config.cwd, "env": self.config.env, "output_limit": self.config.output_limit}
        spec.update({key: value for key, value in optional.items() if value})
        command = [*self.config.interpreter, f"exec 2>&1\n{action.get('command', '')}"]
        try:
            record = self.client.exec(command, cores=self.config.cores, timeout_s=self.config.queue_timeout_s, **spec)
        except errors.ActionError as error:  # timed out, killed, the sandbox lost: partial output, as mini's own envs
            output = failure(error, error.record.error or {}, "did not finish")
        except errors.TangramError as error:
            if errors.config_error(error):
                raise
            output = failure(error, {}, "could not be run")
        else:
            code = record.result.get("exit_code")
            output = {"output": merged(record.result), "returncode": -1 if code is None else code, "exception_info": ""}
        lines = output["output"].lstrip().splitlines(keepends=True)  # mini's rule for a submission
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})
        return output

    def write_files(self, files: Mapping[str, str | bytes]) -> dict[str, Any]:
        """Write files (path relative to the work dir -> text or bytes) into the sandbox between steps."""
        return self.client.write_files(self._environment(), files)

    def read_file(self, path: str) -> bytes:
        """A file's bytes from the sandbox (or an uncompressed tar of a directory)."""
        return self.client.read_file(self._environment(), path)

    def _environment(self) -> str:
        if getattr(self, "environment_id", None) is None:
            raise RuntimeError("the environment is closed")
        return str(self.environment_id)

    def _public_config(self) -> dict[str, Any]:
        public = {key: value for key, value in dataclasses.asdict(self.config).items() if key != "token"}
        return {**public, "environment_id": getattr(self, "environment_id", None)}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self._public_config(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self._public_config(),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    def close(self) -> None:
        """Delete the sandbox (a second call does nothing) and close the client this environment made."""
        environment, self.environment_id = getattr(self, "environment_id", None), None
        try:
            if environment is not None:
                self.client.delete_environment(environment)
        except errors.NotFoundError:
            pass  # already gone (the broker's idle TTL)
        finally:
            if self._own_client:
                self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
