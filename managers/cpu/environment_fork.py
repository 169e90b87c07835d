"""Forking a trajectory environment (issue 38): N environments from one prepared sandbox's filesystem, each its own
trajectory, so that GRPO's N rollouts from one state (repository checked out, dependencies installed) do not each
build it again.

Why a snapshot image: ``docker commit`` writes the source's writable layer once, and each fork is a container created
from it, that layer shared under its own empty one; copying the files into N fresh containers writes them N times
(``loadtest/bench_fork.py`` measures both). The image is untagged and goes with the last container made from it.

Consistency: the fork takes the source's turn alone (``managers/cpu/turns.py``), as a file op does: it waits for the
running commands, and the source's later commands wait for it; between commands the sandbox is frozen, so what is
committed is a quiescent filesystem. Forks go on the source's node (the image is on its engine), each with the
source's image, memory and user; they count as new environments for the broker's and the task's caps. A fork that
fails part-way removes every fork it made, and so the image.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from managers.cpu.environment import Environment, EnvState, LossCause
from managers.cpu.environments import Environments
from sandboxes.backend import SandboxError
from tangram.core.errors import (
    ActionFailed,
    Conflict,
    RequestError,
    TooMany,
    Unavailable,
    Unprocessable,
)

#: the longest trajectory name (``tangram.core.names.NAME``)
NAME_CHARS = 128
#: when to try a fork again that found its source busy past the wait
RETRY_AFTER_S = 1.0


def fork_names(env: Environment, n: int, trajectories: list[str] | None) -> list[str]:
    """The forks' trajectories: those named, one per fork, or ``<source trajectory or id>-fork-<i>`` (the source's
    part cut to keep a name's length)."""
    if trajectories is None:
        base = env.trajectory or env.id
        return [base[:NAME_CHARS - len(f"-fork-{i}")] + f"-fork-{i}" for i in range(n)]
    if len(trajectories) != n:
        raise Unprocessable("trajectories", f"names {len(trajectories)} trajectories for n = {n} forks")
    if len(set(trajectories)) != n:
        raise Unprocessable("trajectories", "names a trajectory twice")
    return trajectories


def _check(environments: Environments, env: Environment, names: list[str]) -> None:
    """Refuse what cannot be made, before anything is reserved: names taken, no room on the broker or the node."""
    for name in names:
        existing = environments.of_trajectory(env.task, name)
        if existing is not None:
            raise Conflict("trajectories", f"trajectory {name!r} of task {env.task!r} already has environment "
                                           f"{existing.id}")
    if env.state in (EnvState.LOST, EnvState.DESTROYED):
        raise Conflict("id", f"environment {env.id} is {env.state.value}: {env.lost_reason or 'deleted'}",
                       code=f"environment_{env.state.value}")
    if len(environments) + len(names) > environments.config.max_environments:
        raise TooMany("n", f"the broker holds {len(environments)} environments and its limit is "
                           f"{environments.config.max_environments}; delete idle ones or fork fewer")
    node = environments.nodes[env.node]
    if node.lost is not None:
        raise Conflict("id", f"environment {env.id}'s node {node.name} is out of service: {node.lost}")
    memory = env.memory_mb * len(names)
    if node.memory_reserved + memory > node.memory_mb or not node.has_room_for(len(names)):
        raise TooMany("n", f"node {node.name} (the source's, where its forks go) has not {memory} MiB unreserved "
                           f"or room for {len(names)} more sandboxes now; delete idle environments or fork fewer")


async def fork(environments: Environments, env: Environment, names: list[str],
               admit: Callable[[list[str]], None], wait_s: float) -> list[Environment]:
    """One environment per name from ``env``'s filesystem once the commands before the fork have ended (at most
    ``wait_s``). ``admit(names)`` may refuse (raise) before anything is reserved (the per-task caps). Refusals and
    failures as request errors: 409 for a taken name or a lost source, 422 where the source's sandbox cannot be
    forked, 429 past a limit, 503 past the wait or when the engine fails."""
    _check(environments, env, names)
    admit(names)
    node = environments.nodes[env.node]
    forks = [environments.reserve(env.task, name, node, env.image, env.memory_mb, {}, ephemeral=False,
                                  sandbox_user=env.sandbox_user, network=env.network) for name in names]
    image: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    for each in forks:
        environments.create_from(each, image)
    try:
        await _snapshot_into(environments, env, forks, image, wait_s)
    except (TimeoutError, ActionFailed, SandboxError) as error:
        raise _request_error(error, env) from None
    return forks


async def _snapshot_into(environments: Environments, env: Environment, forks: list[Environment],
                         image: asyncio.Future[str], wait_s: float) -> None:
    """Snapshot ``env`` in its turn and wait for ``forks`` to be created from the image; on any failure (a
    cancellation too) remove every fork, and so the image."""
    backend = environments.nodes[env.node].backend
    snapshot = None
    try:
        try:
            async with env.turns.alone(wait_s):
                env.last_used = time.time()
                snapshot = await (await environments.sandbox(env)).snapshot()
        except SandboxError as error:
            if error.lost and env.state is EnvState.READY:
                environments.mark_lost(env, LossCause.SANDBOX_DIED, error.message)
            raise
        image.set_result(snapshot)
        made = await asyncio.gather(*(environments.sandbox(each) for each in forks), return_exceptions=True)
        failed = next((result for result in made if isinstance(result, BaseException)), None)
        if failed is not None:
            raise failed
    except BaseException:
        if not image.done():
            image.set_exception(SandboxError("fork_failed", "the source was not snapshot"))
        await asyncio.gather(*(environments.destroy(each) for each in forks), return_exceptions=True)
        raise
    finally:
        if snapshot is not None:  # unused after a failure; else kept by its forks, and removed with the last
            await backend.drop_snapshot(snapshot)


def _request_error(error: TimeoutError | ActionFailed | SandboxError, env: Environment) -> RequestError:
    """A fork's failure as the request error it is."""
    if isinstance(error, TimeoutError):
        return Unavailable("id", f"environment {env.id} still runs a command past the wait; try again later",
                           retry_after_s=RETRY_AFTER_S)
    if isinstance(error, ActionFailed):  # the source lost or deleted, or a fork's sandbox not created
        refused = Conflict if error.code in ("environment_lost", "environment_destroyed") else Unavailable
        return refused("id", error.message, code=error.code)
    if error.code == "fork_unsupported":
        return Unprocessable("id", error.message, code=error.code)
    if error.lost:
        return Conflict("id", f"environment {env.id} is lost: {error.message}", code=error.code)
    return Unavailable("id", error.message, code=error.code, retry_after_s=RETRY_AFTER_S)
