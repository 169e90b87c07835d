"""The reward services a GPU manager serves: the running ``[gpu]`` config's, those a reload adds (``POST
/v1/admin/reload``) included, which of the added ones are still being prepared, and a reward spec checked against
its service."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any

from managers.gpu.config import GpuConfig, on_this_host
from managers.gpu.dict_view import DictView
from managers.gpu.node import RESOURCE
from reward_services.backend import ServiceSpec
from reward_services.requests import RewardRequest, parse_reward_input, parse_reward_spec
from tangram.core.action import Action
from tangram.core.errors import BadRequest, ConfigError, Conflict, NotFound, Unavailable, Unprocessable

log = logging.getLogger("tangram.gpu")


class ServiceCatalog(DictView[str, ServiceSpec]):
    """Each service's spec by name, read-only outside; ``config`` is the running ``[gpu]`` config (sized for this
    host), whose services a reload extends."""

    def __init__(self, config: GpuConfig) -> None:
        self.config = config
        super().__init__({spec.name: spec for spec in config.services})
        #: services added at runtime and not yet served: "preparing", or "failed: ..." with the reason
        self.preparing: dict[str, str] = {}
        self._preparations: set[asyncio.Task[None]] = set()

    def serving(self) -> list[ServiceSpec]:
        """The services whose actions run now: all but those added at runtime and not prepared yet."""
        return [spec for name, spec in self._items.items() if name not in self.preparing]

    # -- a reward spec against its service ------------------------------------------------------------------

    def request_of(self, action: Action) -> RewardRequest:
        """The action's spec as checked at submit (parsed here first for an action recovered from the store)."""
        if isinstance(action.parsed_spec, RewardRequest):
            return action.parsed_spec
        return self.parse(action)

    def parse(self, action: Action) -> RewardRequest:
        """The reward spec checked against its service; kept on the action."""
        body = parse_reward_spec(action.spec)
        name = body.service
        spec = self._items.get(name)
        if spec is None:
            raise NotFound("spec.service", f"no reward service {name!r}; this broker serves {sorted(self._items)}")
        demand = action.demands.get(RESOURCE)
        if demand is None:
            raise Unprocessable("demand.gpu", f'reward actions run on GPUs: add "gpu": {spec.dops[0]} (or a set '
                                              f'such as {{"choices": {list(spec.dops)}}}) to demand')
        unsupported = [k for k in demand.choices if k not in spec.dops]
        if unsupported:
            raise Unprocessable("demand.gpu", f"service {name!r} runs at DoP {list(spec.dops)}, not {unsupported}")
        try:
            request = parse_reward_input(spec.task, body.input, self.config.limits)
        except BadRequest as error:  # the document allows any object: the service's task decides its fields
            raise Unprocessable(error.field, f"{error.reason} (input for a {spec.task} service)") from None
        action.parsed_spec = RewardRequest(name, request)
        return action.parsed_spec

    def check_prepared(self, name: str) -> None:
        """``Unavailable`` while a service added at runtime is not served yet."""
        state = self.preparing.get(name)
        if state is not None:
            raise Unavailable("spec.service", f"service {name!r} was added at runtime and is not served yet "
                                              f"({state}); retry", retry_after_s=5)

    # -- services added at runtime ----------------------------------------------------------------------------

    def added_by(self, new: GpuConfig) -> list[ServiceSpec]:
        """The services ``new`` adds; ``Conflict`` naming the field for any other change (a restart's)."""
        sized = on_this_host(new)  # as the running config was
        for field in fields(GpuConfig):
            now, running = getattr(sized, field.name), getattr(self.config, field.name)
            if field.name != "services" and now != running:
                raise Conflict(_changed_key(field.name, now, running), "changes need a restart (a reload adds "
                                                                       "services only)")
        given = {spec.name: spec for spec in new.services}
        for name, spec in self._items.items():
            if given.get(name) != spec:
                raise Conflict(f"gpu.services.{name}", "changing or removing a running service needs a restart "
                                                       "(a reload adds services only)")
        return [spec for spec in new.services if spec.name not in self._items]

    def add(self, added: Sequence[ServiceSpec], prepare: Callable[[list[str]], Awaitable[None]]) -> list[str]:
        """Serve ``added`` (admitted on every node) once ``prepare`` has prepared them, which starts now; their
        actions get 503 until then. A failed preparation is kept as their state, with its reason. Returns their
        names."""
        names = [spec.name for spec in added]
        self.config = replace(self.config, services=(*self.config.services, *added))
        for spec in added:
            self._items[spec.name] = spec
            self.preparing[spec.name] = "preparing"
        task = asyncio.create_task(self._prepare_added(names, prepare), name="tangram-prepare-added-services")
        self._preparations.add(task)
        task.add_done_callback(self._preparations.discard)
        return names

    async def _prepare_added(self, names: list[str], prepare: Callable[[list[str]], Awaitable[None]]) -> None:
        try:
            await prepare(names)
        except ConfigError as error:
            log.error("adding services %s: %s", names, error)
            for name in names:
                self.preparing[name] = f"failed: {error.key}: {error.reason}"
            return
        for name in names:
            del self.preparing[name]
        log.info("services %s prepared on every GPU node in service", names)

    async def close(self) -> None:
        """Stop the preparations under way."""
        for task in list(self._preparations):
            task.cancel()
        await asyncio.gather(*self._preparations, return_exceptions=True)


def _changed_key(name: str, new: Any, running: Any) -> str:
    """The first key under ``[gpu] name`` that a reload changed: a node's table, or a key of a sub-table such as
    ``[gpu.fit]``, so that the ``Conflict`` names what the file spells (``ray`` is a copy of ``[ray]``, not a
    ``[gpu]`` table)."""
    if name == "nodes":
        return next((f"gpu.nodes.{a.name}" for a, b in zip(new, running) if a != b), "gpu.nodes")
    if name != "ray" and is_dataclass(new) and type(new) is type(running):
        return next(f"gpu.{name}.{f.name}" for f in fields(new) if getattr(new, f.name) != getattr(running, f.name))
    return f"gpu.{name}"
