"""A trajectory environment's files at any time (issue 38): written or read through its sandbox's executor, in the
environment's turn.

Why not actions: an action is what the scheduler decides about, a demand for resources; a file op holds none (no
core: the idle sandbox is thawed on the cpuset it has, for the milliseconds the op takes). Making it an action would
add a kind to the parser, the store, the OpenAPI union, the simulator and the scheduler for no decision of theirs.
What it needs of the trajectory is order, which the environment's turns give (``managers/cpu/turns.py``): it waits for
the running commands, and the commands that come after it wait for it. Paths are resolved by the executor inside the
sandbox, as its user (``sandboxes/executor_files.py``), never by the broker on the host.
"""

from __future__ import annotations

import time
from typing import TypeVar

from managers.cpu.environment import Environment, EnvState, LossCause
from managers.cpu.environments import Environments
from sandboxes.backend import SandboxError
from sandboxes.file_wire import FileData, FileOp, ReadFile, WriteFiles, Written
from tangram.core.errors import ActionFailed, Conflict, NotFound, RequestError, TooLarge, Unavailable, Unprocessable

T = TypeVar("T")
#: the executor's refusals that are the request's fault, by the request error they are
REFUSALS: dict[str, type[RequestError]] = {"file_not_found": NotFound, "file_too_large": TooLarge}
#: when to try a file op again that found its environment busy past the wait
RETRY_AFTER_S = 1.0


async def in_turn(environments: Environments, env: Environment, op: FileOp[T], field: str, wait_s: float) -> T:
    """``op`` in ``env``'s sandbox once the commands before it have ended (at most ``wait_s``); refusals and
    failures as request errors naming ``field``: 404 for no such file, 413 past a limit, 422 for a path that leaves
    the working directory, a special file, or a write the sandbox's user may not make."""
    try:
        async with env.turns.alone(wait_s):
            return await alone(environments, env, op)
    except TimeoutError:
        raise Unavailable("id", f"environment {env.id} still runs a command after {wait_s:g} s; try again later",
                          retry_after_s=RETRY_AFTER_S) from None
    except SandboxError as error:
        raise request_error(error, env, field) from None
    except ActionFailed as failure:
        raise Conflict("id", failure.message, code=failure.code) from None


async def alone(environments: Environments, env: Environment, op: FileOp[T]) -> T:
    """``op`` in ``env``'s sandbox, the caller holding the environment's turn alone. Raises ``SandboxError``, or
    ``ActionFailed`` for an environment lost or destroyed before."""
    env.last_used = time.time()
    sandbox = await environments.sandbox(env)
    try:
        return await sandbox.files(op)
    except SandboxError as error:
        if error.lost and env.state is EnvState.READY:
            environments.mark_lost(env, LossCause.SANDBOX_DIED, error.message)
        raise
    finally:
        env.last_used = time.time()


def request_error(error: SandboxError, env: Environment, field: str) -> RequestError:
    """A file op's ``SandboxError`` as the request error it is."""
    if error.code.startswith("file_") or error.code == "executor_too_old":
        return REFUSALS.get(error.code, Unprocessable)(field, error.message, code=error.code)
    if error.lost:
        return Conflict("id", f"environment {env.id} is lost: {error.message}", code=error.code)
    return Unavailable("id", error.message, code=error.code, retry_after_s=RETRY_AFTER_S)


async def write_files(environments: Environments, env: Environment, files: WriteFiles, wait_s: float) -> Written:
    return await in_turn(environments, env, files, "files", wait_s)


async def read_file(environments: Environments, env: Environment, path: str, limit: int, wait_s: float) -> FileData:
    return await in_turn(environments, env, ReadFile(path, limit), "path", wait_s)
