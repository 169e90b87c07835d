"""What an ``exec`` action answers its client, from what the executor answered about its command.

Why apart from the manager: the result's fields and the failures a command can end in (the executor refused it, it
ran past its deadline, it ran out of memory) are the action's contract with its client, not the manager's book-keeping
of nodes and cores.
"""

from __future__ import annotations

from typing import Any

from managers.cpu.environment import Environment
from sandboxes.exec_wire import ExecResult
from tangram.core.errors import ActionFailed


def action_result(result: ExecResult, env: Environment, cores: tuple[int, ...], setup_s: float,
                  limit: str = "timeout_s", limit_s: float | None = None) -> dict[str, Any]:
    """The action's result: the command's exit, output and duration, and where it ran (its environment, node,
    cores and the seconds its sandbox took to be ready). Raises ``ActionFailed`` for a command the executor could
    not run, one killed at its time limit and one killed for its memory (with its output, for the client to see).
    ``limit`` names the limit its time ran under (``timeout_s``, the action's deadline from submission, or
    ``run_timeout_s``, the command's own run), of ``limit_s`` seconds: a timed-out action says which fired, since
    one that waited long in the queue is not the command's fault."""
    output: dict[str, Any] = {"exit_code": result.exit_code, "signal": result.signal, "stdout": result.stdout,
                              "stderr": result.stderr, "stdout_bytes": result.stdout_bytes,
                              "stderr_bytes": result.stderr_bytes, "stdout_truncated": result.stdout_truncated,
                              "stderr_truncated": result.stderr_truncated, "duration_s": result.duration_s}
    if result.pid is not None:  # a background command's
        output["pid"] = result.pid
    where = {"environment": env.id, "node": env.node, "cores": list(cores), "setup_s": round(setup_s, 6)}
    if result.error:
        raise ActionFailed("exec_error", result.error, **where)
    if result.timed_out:
        said = "its run_timeout_s" if limit == "run_timeout_s" else "the action's deadline (timeout_s, from submission)"
        raise ActionFailed("timed_out", f"the command ran past {said} of {limit_s} s; it was killed with its whole "
                                        f"process tree", limit=limit, **output, **where)
    if result.oom_killed:
        raise ActionFailed("out_of_memory", f"the command exceeded the environment's memory limit ({env.memory_mb} "
                                            f"MiB) and was killed; the environment is still usable", **output, **where)
    return {**output, **where}
