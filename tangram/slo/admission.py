"""SLO admission of RL tasks sharing the GPU pool (issue 18): the plans in force, admitted together or not at all.

A task's plan (``tangram/slo/plan.py``) comes from its ``[tasks.NAME.slo]`` table or from ``PUT /v1/tasks/NAME/slo``
(kept in the store, so that it outlives a restart). The config's win over the store's for the same task; the API
changes only the store's. A set of plans is admitted only if the GPU manager serves every plan's service and no
task's predicted slowdown passes its SLO, with the pool as it is: the GPUs of the manager's nodes in service (a
lost node's do not count) and each service's restore as the manager expects it now. A refusal names the task at
fault, and nothing changes. The GPUs reserved for the plans in force follow the pool: they are worked out again
when a reward action ends on a pool that is no longer the one they were worked out on (a node lost or back, a
service's expected restore moved by more than ``RESTORE_DRIFT``).

The tracker of measured attainment (``tangram/slo/attainment.py``) is fed by the broker and judges by the plans
in force.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reward_services.backend import ServiceSpec
from tangram.core.action import Action, Kind
from tangram.core.config_tables import table
from tangram.core.errors import ConfigError, Conflict, NotFound, Unavailable, Unprocessable
from tangram.core.seam import CyclePlugins, MetricsRegistry
from tangram.metrics import SloCollector, SloFigures
from tangram.sched.reserved_shares import ReservedShares
from tangram.slo.attainment import Attainment, SloAttainment
from tangram.slo.plan import Pool, Prediction, SloPlan, first_breach, predict, reservations
from tangram.slo.pool import GpuPool
from tangram.store.store import Store

log = logging.getLogger("tangram.slo")

#: how far (relative) a service's expected restore may move from the one the reservations were worked out with
RESTORE_DRIFT = 0.1


@dataclass(frozen=True)
class Refusal:
    """Why a set of plans is not admitted: the task at fault, the part of its plan (``slo`` or ``slo.service``),
    and why; ``breach``: that task's prediction, when its SLO would break."""

    task: str
    field: str
    reason: str
    breach: Prediction | None = None

    def config_error(self) -> ConfigError:
        return ConfigError(f"tasks.{self.task}.{self.field}", self.reason)


def finite(value: float | None) -> float | None:
    """JSON has no infinity: an unbounded figure is null."""
    return value if value is None or math.isfinite(value) else None


class SloAdmission:
    def __init__(self, gpus: GpuPool | None, store: Store, config_plans: Mapping[str, SloPlan]) -> None:
        """Admit the config's plans on ``gpus`` (None: the broker has no GPU manager; ``ConfigError`` naming
        ``tasks.NAME.slo...`` if they are refused); the store's plans come in with ``load``. The broker's cycle
        runs it through ``plugins``."""
        self.gpus = gpus
        self.store = store
        self.config_plans = dict(config_plans)
        self.stored: dict[str, SloPlan] = {}
        #: stored plans not admitted at start (the config or the pool changed since): task -> why
        self.shelved: dict[str, str] = {}
        #: held from a check to its change, so that two changes are never admitted against the same plans
        self.lock = asyncio.Lock()
        refusal = self.refusal(self.config_plans)
        if refusal is not None:
            raise refusal.config_error()
        #: the attainment of the plans in force and the GPUs reserved for them, which the broker's passes put
        #: ahead; both only over a GPU pool: without one no plan is ever in force
        self.tracker = SloAttainment(self._service_of, gpus.resource) if gpus is not None else None
        self.shares = ReservedShares(gpus.resource) if gpus is not None else None
        #: the pool the reservations in force were worked out on
        self._reserved_on: Pool | None = None
        self._in_force()

    def plugins(self) -> CyclePlugins:
        """The reserve order, the tracker and this admission as watchers (reservations that follow the pool), and
        the SLO figures as metrics; without a GPU pool only the metrics."""
        if self.tracker is None or self.shares is None:
            return CyclePlugins(metrics=self._register)
        return CyclePlugins(reserve_order=self.shares, watchers=(self.tracker, self), metrics=self._register)

    def _register(self, registry: MetricsRegistry) -> None:
        registry.register(SloCollector(self._figures))

    @property
    def plans(self) -> dict[str, SloPlan]:
        return {**self.stored, **self.config_plans}

    def _service_of(self, action: Action) -> str:
        assert self.gpus is not None, "reward actions run on the GPU manager"
        return self.gpus.service_of(action)

    def pool(self, adding: Sequence[ServiceSpec] = ()) -> Pool | None:
        """The GPUs in service and each service's expected restore; ``adding``: services a reload would add."""
        if self.gpus is None:
            return None
        return Pool(self.gpus.gpus_in_service(), self.gpus.expected_restore_s(adding))

    def refusal(self, plans: Mapping[str, SloPlan], adding: Sequence[ServiceSpec] = ()) -> Refusal | None:
        """Why ``plans`` cannot all be in force together, or None."""
        if not plans:
            return None
        pool = self.pool(adding)
        if pool is None or pool.gpus == 0:
            why = "this broker has no GPU manager" if pool is None else "the GPU manager has no nodes"
            return Refusal(next(iter(plans)), "slo", f"no GPU pool to plan on: {why}")
        for task, plan in plans.items():
            if plan.service not in pool.restore_s:
                return Refusal(task, "slo.service", f"no reward service {plan.service!r}; this broker serves "
                                                    f"{sorted(pool.restore_s)}")
        breach = first_breach(plans, pool)
        if breach is None:
            return None
        task, prediction = breach
        slowdown = "unbounded (the pool is overloaded)" if not math.isfinite(prediction.slowdown) \
            else f"{prediction.slowdown:.3g}"
        source = "" if task in self.config_plans or task not in self.stored else " (planned through the API)"
        return Refusal(task, "slo", f"the SLO of task {task!r}{source} would break: its predicted step slowdown is "
                                    f"{slowdown} against its SLO of {prediction.slo:g} on {pool.gpus} GPUs "
                                    f"(reward phase at most {prediction.phase_s:.3g} s here, "
                                    f"{prediction.solo_phase_s:.3g} s dedicated)", prediction)

    # -- changes ---------------------------------------------------------------------------------------------

    async def load(self) -> None:
        """Admit the store's plans, oldest first, each with those admitted before it; one refused now (the config
        or the pool changed since it was made) is shelved with the reason and stays in the store."""
        async with self.lock:
            for task, raw in (await self.store.load_slo_plans()).items():
                try:
                    plan = table(SloPlan, raw, f"stored plan of {task}")
                except ConfigError as error:
                    self.shelved[task] = f"unreadable: {error}"
                else:
                    if task in self.config_plans:  # kept under the config's, in force again if that one goes
                        log.info("the config's SLO of task %r is in force, not the one made through the API", task)
                        self.stored[task] = plan
                        continue
                    refusal = self.refusal({**self.plans, task: plan})
                    if refusal is None:
                        self.stored[task] = plan
                        continue
                    self.shelved[task] = refusal.reason
                log.error("the SLO of task %r made through the API is not in force: %s (DELETE /v1/tasks/%s/slo "
                          "removes it)", task, self.shelved[task], task)
            self._in_force()

    def configure(self, config_plans: Mapping[str, SloPlan]) -> None:
        """The config's plans from now on (``POST /v1/admin/reload``, after ``refusal`` let them in)."""
        self.config_plans = dict(config_plans)
        self._in_force()

    async def put(self, task: str, plan: SloPlan) -> None:
        """Plan ``task`` (replacing its plan) if every plan then holds; else 409 naming the task that would break,
        or 422 naming the field, and nothing changes."""
        async with self.lock:
            self._not_in_config(task)
            refusal = self.refusal({**self.plans, task: plan})
            if refusal is not None and refusal.breach is not None:
                raise Conflict("slo", f"{refusal.reason}; nothing changed", task=refusal.task,
                               predicted_slowdown=finite(refusal.breach.slowdown), slo=refusal.breach.slo)
            if refusal is not None:
                raise Unprocessable(refusal.field.removeprefix("slo."), refusal.reason)
            await self._written(self.store.put_slo_plan(task, dataclasses.asdict(plan), time.time()))
            self.stored[task] = plan
            self.shelved.pop(task, None)
            self._in_force()

    async def delete(self, task: str) -> None:
        async with self.lock:
            self._not_in_config(task)
            if task not in self.stored and task not in self.shelved:
                raise NotFound("task", f"task {task!r} has no SLO made through the API")
            await self._written(self.store.delete_slo_plan(task))
            self.stored.pop(task, None)
            self.shelved.pop(task, None)
            self._in_force()

    def _in_force(self) -> None:
        """Judge attainment by the plans in force, and reserve the GPUs they need on the pool as it is now."""
        if self.tracker is None or self.shares is None:
            return
        plans = self.plans
        self.tracker.plan(plans)
        pool = self._reserved_on = self.pool()
        self.shares.reserve(reservations(plans, pool) if plans and pool is not None and pool.gpus else {})

    # -- the broker's watcher: reservations that follow the pool ----------------------------------------------

    def submitted(self, action: Action) -> None:
        """Nothing: a queued action changes neither the pool nor the plans."""

    def ended(self, action: Action) -> None:
        """Work the reservations out again if the pool has moved since they were (what a reward action's end
        follows: a restore learned, a node lost with the actions it ran); logged with what changed."""
        if action.kind is not Kind.REWARD or not self.plans or self.shares is None:
            return
        before, now = self._reserved_on, self.pool()
        if before is None or now is None or not _moved(before, now):
            return
        held = dict(self.shares.reserved)
        self._in_force()
        changed = now.gpus != before.gpus or self.shares.reserved != held  # else a restore moved, to no effect
        log.log(logging.INFO if changed else logging.DEBUG,
                "SLO reservations worked out again on %d GPUs (were %d), restores %s: %s (were %s)", now.gpus,
                before.gpus, {name: round(seconds, 3) for name, seconds in now.restore_s.items()},
                self.shares.reserved, held)

    def _not_in_config(self, task: str) -> None:
        if task in self.config_plans:
            raise Conflict("task", f"the SLO of task {task!r} is in the config (tasks.{task}.slo): change it there, "
                                   f"then POST /v1/admin/reload")

    @staticmethod
    async def _written(write: Awaitable[object]) -> None:
        try:
            await write
        except Exception as error:  # noqa: BLE001 - any driver error: the database cannot answer now
            log.error("SLO plan not written: %r", error)
            raise Unavailable("store", "the database is unavailable; nothing changed, retry") from None

    # -- views -----------------------------------------------------------------------------------------------

    def _predictions(self, pool: Pool | None) -> dict[str, Prediction]:
        plans = self.plans
        return predict(plans, pool) if plans and pool is not None and pool.gpus else {}

    def describe(self) -> dict[str, Any]:
        """Every planned task: its plan, its prediction with the pool as it is now, and its attainment so far."""
        pool = self.pool()
        predictions = self._predictions(pool)
        tasks = []
        for task, plan in sorted(self.plans.items()):
            prediction = predictions[task]
            tasks.append({"task": task, "source": "config" if task in self.config_plans else "store",
                          "plan": dataclasses.asdict(plan),
                          "prediction": {"phase_s": finite(prediction.phase_s),
                                         "solo_phase_s": prediction.solo_phase_s,
                                         "slowdown": finite(prediction.slowdown), "slo": prediction.slo,
                                         "within": prediction.within, "reserved_gpus": prediction.reserved_gpus},
                          "reserved_gpus": self._reserved(task), "attainment": _attainment_json(self._attained(task))})
        return {"pool": None if pool is None else {"gpus": pool.gpus, "restore_s": pool.restore_s},
                "tasks": tasks, "shelved": dict(self.shelved)}

    def summary(self) -> list[dict[str, Any]]:
        """Per planned task, its SLO, prediction and attainment (``GET /v1/resources``: the status views')."""
        return [{"task": row.task, "slo": row.slo, "predicted_slowdown": finite(row.predicted_slowdown),
                 "reserved_gpus": row.reserved_gpus,
                 **_attainment_json(self._attained(row.task))} for row in self._figures()]

    def _figures(self) -> Iterable[SloFigures]:
        for task, prediction in sorted(self._predictions(self.pool()).items()):
            attained = self._attained(task)
            yield SloFigures(task, prediction.slo, prediction.slowdown, self._reserved(task),
                             attained.windows, attained.within, attained.last_slowdown)

    def _reserved(self, task: str) -> int:
        return 0 if self.shares is None else self.shares.reserved.get(task, 0)

    def _attained(self, task: str) -> Attainment:
        return Attainment() if self.tracker is None else self.tracker.tasks.get(task, Attainment())


def _moved(before: Pool, now: Pool) -> bool:
    """Whether the pool's GPUs differ, or a service's expected restore moved by more than ``RESTORE_DRIFT``."""
    if before.gpus != now.gpus or before.restore_s.keys() != now.restore_s.keys():
        return True
    return any(abs(now.restore_s[name] - seconds) > RESTORE_DRIFT * seconds
               for name, seconds in before.restore_s.items())


def _attainment_json(attained: Attainment) -> dict[str, Any]:
    return {"windows": attained.windows, "within": attained.within, "attainment": attained.fraction,
            "last_slowdown": finite(attained.last_slowdown)}
