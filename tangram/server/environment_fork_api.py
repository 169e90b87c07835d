"""``POST /v1/environments/{id}/fork?n=N``: N environments from one prepared environment's filesystem, each its own
trajectory (``managers/cpu/environment_fork.py`` says how and why).

The forks' trajectories are the body's ``trajectories`` (one name per fork; ``n`` may then be left out), else
``<source trajectory or id>-fork-<i>``. ``n`` is at most ``[cpu.limits] max_fork``; the task's caps count every fork.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import Field, TypeAdapter

from managers.cpu.environment_fork import fork, fork_names
from tangram.broker import Broker
from tangram.core.action import Kind
from tangram.core.errors import BadRequest, Unprocessable
from tangram.core.names import Name
from tangram.core.schema import Schema, parse_json
from tangram.server.common import BROKER, SERVER, json_response, read_body
from tangram.server.environments_api import EnvironmentManager, environment_manager, environment_named


class ForkRequest(Schema):
    """How to name the forks of an environment (the body may be left out)."""

    trajectories: list[Name] | None = Field(default=None, min_length=1,
                                            description="one trajectory per fork, none of the task's yet")


FORK_REQUEST = TypeAdapter(ForkRequest)


def max_fork(broker: Broker) -> int | None:
    """``[cpu.limits] max_fork``; None without a CPU manager."""
    manager = broker.executor.get(Kind.EXEC)
    return manager.config.limits.max_fork if isinstance(manager, EnvironmentManager) else None


def fork_count(raw: str | None, named: int | None, limit: int) -> int:
    """``?n=``: how many forks, 1 to ``limit``; left out, as many as the trajectories named."""
    if raw is None:
        if named is None:
            raise Unprocessable("n", "is required (or name the forks' trajectories in the body)")
        if named > limit:
            raise Unprocessable("trajectories", f"names {named} forks; at most {limit} at once ([cpu.limits] "
                                                f"max_fork)")
        raw = str(named)
    try:
        n = int(raw)
    except ValueError:
        raise BadRequest("n", f"must be an integer, not {raw!r}") from None
    if not 1 <= n <= limit:
        raise BadRequest("n", f"must be between 1 and {limit} ([cpu.limits] max_fork), not {n}")
    return n


async def fork_environment(request: web.Request) -> web.Response:
    manager = environment_manager(request)
    env = environment_named(request, manager)
    body = parse_json(FORK_REQUEST, await read_body(request)) if request.body_exists else ForkRequest()
    named = None if body.trajectories is None else len(body.trajectories)
    n = fork_count(request.query.get("n"), named, manager.config.limits.max_fork)
    names = fork_names(env, n, body.trajectories)
    ledger = request.app[BROKER].ledger
    forks = await fork(manager.environments, env, names,
                       lambda wanted: ledger.check_environments(env.task, list(wanted), env.memory_mb, manager),
                       request.app[SERVER].max_wait_s)
    return json_response({"source": env.id, "environments": [each.to_json() for each in forks]}, status=201)


def add_environment_fork_routes(app: web.Application) -> None:
    app.router.add_post("/v1/environments/{id}/fork", fork_environment)
