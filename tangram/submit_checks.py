"""What a submit is refused for before anything of it is queued: a kind or a resource this broker lacks, a demand
no pool could ever hold (or none in service now), a manager's own refusal of the spec, a task over its caps."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from tangram.core.action import Action
from tangram.core.errors import BadRequest, RequestError, Unavailable, Unprocessable
from tangram.execution import Executions
from tangram.sched.cycle import Cycle
from tangram.sched.tenants import MAX_RETRY_S


class SubmitChecks:
    def __init__(self, cycle: Cycle, executions: Executions) -> None:
        self.cycle = cycle
        self.executions = executions

    def validate(self, action: Action, where: str) -> None:
        """Refuse ``action`` naming the field (prefixed with ``where``: its place in a batch) and the reason."""
        owner, executor = self.cycle.owner, self.cycle.executor
        if action.kind not in executor:
            raise Unprocessable(where + "kind", f"no manager on this broker executes {action.kind.value!r} actions")
        for resource in action.demands:
            if resource not in owner:
                raise BadRequest(f"{where}demand.{resource}", f"unknown resource; this broker has {sorted(owner)}")
            largest = owner[resource].largest_pool(resource)
            if largest == 0:  # its nodes join, or come back, from the Ray cluster
                raise Unavailable(f"{where}demand.{resource}", f"no {resource} node is in service now; retry once "
                                                              f"one has joined or come back", retry_after_s=5)
            if action.demands[resource].min > largest:
                raise Unprocessable(f"{where}demand.{resource}",
                                    f"minimum {action.demands[resource].min} units can never fit: the largest "
                                    f"pool has {largest}")
        try:
            executor[action.kind].validate(action)
            for manager in {id(owner[r]): owner[r] for r in action.demands}.values():
                if manager is not executor[action.kind]:
                    manager.validate(action)
        except RequestError as error:
            if where:
                error.field = where + error.field
            raise

    def check_caps(self, actions: Sequence[Action], replayed: Sequence[Action | None]) -> None:
        """The per-task caps on what this submit would newly queue (idempotent replays, ``replayed``, and repeated
        keys within the submit count once); raises ``OverCap`` (429) before anything is queued."""
        fresh: list[Action] = []
        keys: set[tuple[str, str]] = set()
        for action, earlier in zip(actions, replayed, strict=True):
            if earlier is not None:
                continue
            if action.idempotency_key is not None:
                if (action.task, action.idempotency_key) in keys:
                    continue
                keys.add((action.task, action.idempotency_key))
            fresh.append(action)
        self.cycle.ledger.check_submit(fresh, self.cycle.environment_host, self.retry_after)

    def retry_after(self, task: str) -> int:
        """Seconds until one of ``task``'s queued actions can expect to start: the soonest expected end among its
        running ones (at least 1 s, at most ``MAX_RETRY_S``; 1 s when none runs)."""
        now = time.time()
        default_s = self.cycle.durations.default_s
        ends = [(r.action.started_at or now) + (r.action.expected_duration_s or default_s) - now
                for r in self.executions.running.values() if r.action.task == task]
        return min(MAX_RETRY_S, max(1, math.ceil(min(ends)))) if ends else 1
