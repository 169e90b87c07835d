"""TRL's ``environment_factory`` (``GRPOTrainer``, TRL 1.16) over broker sandboxes, one per rollout.

``GRPOTrainer(environment_factory=BrokerSandboxFactory(url, task="swe-rl", reward_command="pytest -q"), ...)``: TRL
calls the factory to probe the class and whenever a batch needs more instances, pools them, calls ``reset(**example)``
before each rollout and offers every public method but ``reset``/``get_reward`` to the model as a tool. ``reset``
deletes the last rollout's sandbox and makes a fresh one (with the example's ``files`` column, path -> text);
``run_command`` is an ``exec`` there, ``write_file``/``read_file`` the client's ``write_files``/``read_file``;
``get_reward`` (with ``reward_command``; once per finished rollout) is 1.0 when that command exits 0, else 0.0. TRL
never closes an environment: ``factory.close()`` deletes the sandboxes still held (else ``cpu.idle_ttl_s`` does).

TRL makes what a tool raises the model's observation (``except Exception``), so a refusal that says the setup is wrong
(401, 403, a 422 on anything but the command) raises ``BrokerConfigError``, a ``BaseException``: it stops the
training step instead of being trained on. Other broker errors are observations.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from tangram_client.errors import ActionError, TangramError, config_error
from tangram_client.sync_client import TangramClient


class BrokerConfigError(BaseException):
    """The broker refused a call for the setup (token, task, spec): a ``BaseException``, past TRL's ``except``."""


def observation(error: TangramError) -> str:
    """A broker error as the model's observation; ``BrokerConfigError`` when it says the setup is wrong."""
    if config_error(error):
        raise BrokerConfigError(f"the broker refuses this environment's calls (its configuration): {error}") from error
    return f"Error: {error}"


def format_result(result: Mapping[str, Any]) -> str:
    """An exec result (or a failed action's partial output) as text for the model."""
    lines = [f"exit code: {result['exit_code']}"] if result.get("exit_code") is not None else []
    lines += [f"{stream}:\n{str(result[stream]).rstrip()}" for stream in ("stdout", "stderr") if result.get(stream)]
    return "\n".join(lines) or "(no output)"


class BrokerSandbox:
    """One rollout's sandbox at the broker; TRL offers its public methods to the model as tools."""

    def __init__(self, factory: BrokerSandboxFactory) -> None:
        self._factory, self._client = factory, factory.client
        self.environment: str | None = None  # the broker's id of this rollout's sandbox
        self.last_result: dict[str, Any] = {}  # the last command's exec result (or failed action's error)

    def reset(self, **example: Any) -> str | None:
        """Start a rollout: delete the last rollout's sandbox and make a fresh one with the example's ``files``."""
        self._close()
        try:
            record = self._client.create_environment(trajectory=f"trl-{uuid.uuid4().hex}",
                                                     files=example.get("files") or None, **self._factory.sandbox)
        except TangramError as error:
            raise RuntimeError(observation(error)) from error  # no rollout without its sandbox
        self.environment = str(record["id"])
        return None

    def run_command(self, command: str) -> str:
        """Run a shell command in your sandbox, a Linux container with python3 and pytest, in /workspace.

        Args:
            command: the shell command to run
        """
        self.last_result = {}
        try:
            record = self._client.exec(command, environment=self._env(), **self._factory.exec_spec)
        except ActionError as error:
            self.last_result = dict(error.record.error or {})
            said = f"Error: the command did not finish ({error.code}): {error.message}"
            return f"{said}\n{format_result(self.last_result)}"
        except TangramError as error:
            return observation(error)
        self.last_result = dict(record.result or {})
        return format_result(self.last_result)

    def write_file(self, path: str, content: str) -> str:
        """Write a text file into your sandbox, replacing any file of that name.

        Args:
            path: the file's path, relative to /workspace
            content: the file's text
        """
        try:
            answer = self._client.write_files(self._env(), {path: content})
        except TangramError as error:
            return observation(error)
        return f"wrote {answer.get('bytes', len(content.encode()))} bytes to {path}"

    def read_file(self, path: str) -> str:
        """Read a text file from your sandbox.

        Args:
            path: the file's path, relative to /workspace
        """
        try:
            return self._client.read_file(self._env(), path).decode(errors="replace")
        except TangramError as error:
            return observation(error)

    def _env(self) -> str:
        if self.environment is None:
            raise RuntimeError("reset() has not made this rollout's sandbox yet")
        return self.environment

    def _close(self) -> None:
        """Delete this rollout's sandbox (not a tool: TRL skips names starting with ``_``)."""
        environment, self.environment = self.environment, None
        if environment is not None:
            with suppress(TangramError):  # already gone, or left to the broker's idle TTL
                self._client.delete_environment(environment)


class ScoredBrokerSandbox(BrokerSandbox):
    """A ``BrokerSandbox`` that owns its reward (TRL calls ``get_reward`` once per finished rollout)."""

    def get_reward(self) -> float:
        """``reward_command``'s verdict in this rollout's sandbox: 1.0 when it exits 0, else 0.0."""
        said = self.run_command(str(self._factory.reward_command))
        return 1.0 if self.last_result.get("exit_code") == 0 and not said.startswith("Error:") else 0.0


class BrokerSandboxFactory:
    """TRL's ``environment_factory``: each call makes one rollout's environment; all share one client. ``token``: the
    broker's bearer token, else ``$TANGRAM_TOKEN``. ``exec_spec``: ``exec``'s options for every command (``cores``,
    ``run_timeout_s``, ``output_limit``...); ``sandbox``: ``create_environment``'s (``image``, ``memory_mb``...)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8300", *, task: str, token: str | None = None,
                 reward_command: str | None = None, exec_spec: Mapping[str, Any] | None = None,
                 sandbox: Mapping[str, Any] | None = None, retries: int = 3) -> None:
        self.client = TangramClient(base_url, task=task, token=token, retries=retries)
        self.reward_command, self.exec_spec, self.sandbox = reward_command, dict(exec_spec or {}), dict(sandbox or {})
        self.instances: list[BrokerSandbox] = []

    def __call__(self) -> BrokerSandbox:
        kind = BrokerSandbox if self.reward_command is None else ScoredBrokerSandbox
        self.instances.append(kind(self))
        return self.instances[-1]

    def close(self) -> None:
        """Delete every sandbox the instances still hold, and close the client."""
        for instance in self.instances:
            instance._close()
        self.client.close()
