"""A service agent: one GPU node's reward-service instances of one kind behind plain, picklable calls (issue 17).

The agent runs on its GPU node (``managers/remote/broker/ray_service_agents.py`` places it there as a Ray actor) and
holds that node's own backend (the torch worker, or SGLang servers), so weights move between the node's host memory and
its GPUs without crossing the network. A broker elsewhere drives it through
``managers/remote/broker/agent_services.py``, a ``ServiceBackend`` like any other: the GPU manager's chunks, admission
and LRU residency do not know the node is remote.

Every call answers as ``managers/remote/replies.py`` says, and comes through ``FencedAgent.call`` with its broker's
epoch. The agent checks a request as the REST API does (the same parser and limits): the cluster is the trust
boundary, and a caller inside it that skipped the API must not hand a model an oversized request either. An agent
that Ray restarted holds no instances: calls for the old ones answer ``service_unavailable``, and the GPU manager
makes them afresh (its path for a broken instance).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from managers.remote.channel_frames import FRAME_SLACK_BYTES
from managers.remote.node.agent_channels import AgentChannels
from managers.remote.replies import FencedAgent, replying
from reward_services.backend import ServiceBackend, ServiceError, ServiceInstance, ServiceSpec
from reward_services.requests import RewardLimits, parse_reward_input
from tangram.core.errors import RequestError


class ServiceAgent(FencedAgent):
    """One node's instances of one backend kind, by the ids their broker gave them."""

    def __init__(self, make_backend: Callable[[], ServiceBackend], limits: RewardLimits,
                 channel_path: Path | None = None, channel_address: str | None = None) -> None:
        """``make_backend()`` makes this node's backend on the first prepare; ``limits`` bound each request.
        ``channel_path``, ``channel_address``: where it serves a broker without Ray (``AgentChannels``); None: not
        there."""
        self._make_backend = make_backend
        self._limits = limits
        self._backend: ServiceBackend | None = None
        self._instances: dict[int, ServiceInstance] = {}
        self._channels = AgentChannels(self.call, channel_path, channel_address,
                                       limits.max_input_bytes + FRAME_SLACK_BYTES)

    def _instance(self, instance_id: int) -> ServiceInstance:
        instance = self._instances.get(instance_id)
        if instance is None:
            raise ServiceError("service_unavailable", f"this node's service agent holds no instance {instance_id} "
                                                      f"(it was restarted, or the instance was closed)")
        return instance

    def _made_backend(self) -> ServiceBackend:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    @replying
    async def channel(self, broker_host: str, tls: bool) -> dict[str, Any] | None:
        """Where a broker on host ``broker_host`` calls this agent without Ray (``AgentChannels.where``)."""
        return await self._channels.where(broker_host, tls)

    @replying
    async def prepare(self, instance_id: int, spec: ServiceSpec, devices: tuple[int, ...]) -> dict[str, Any]:
        """Make and prepare the instance; answers its description."""
        if instance_id in self._instances:
            raise ServiceError("prepare_failed", f"instance {instance_id} exists already on this node")
        try:
            instance = self._made_backend().instance(spec, devices)
        except ValueError as error:  # the backend refuses the spec (a task it does not serve, no devices)
            raise ServiceError("prepare_failed", str(error)) from None
        self._instances[instance_id] = instance
        try:
            await instance.prepare()
        except BaseException:
            del self._instances[instance_id]
            with contextlib.suppress(Exception):  # the prepare's own error is the one to report
                await instance.close()
            raise
        return instance.describe()

    @replying
    async def restore(self, instance_id: int) -> None:
        await self._instance(instance_id).restore()

    @replying
    async def evict(self, instance_id: int) -> None:
        await self._instance(instance_id).evict()

    @replying
    async def infer(self, instance_id: int, request: dict[str, Any]) -> dict[str, Any]:
        instance = self._instance(instance_id)
        try:
            checked = parse_reward_input(instance.spec.task, request, self._limits, "request")
        except RequestError as error:
            raise ServiceError("bad_input", f"{error.field}: {error.reason}") from None
        return await instance.infer(checked)

    # the disk tier of this node (``managers/gpu/disk_tier.py`` decides when; the files are on this node's disk)

    @replying
    async def disk_room_mb(self, names: list[str]) -> int:
        return await self._made_backend().disk_room_mb(names)

    @replying
    async def spill(self, spec: ServiceSpec) -> None:
        await self._made_backend().spill(spec)

    @replying
    async def drop_host(self, spec: ServiceSpec) -> None:
        await self._made_backend().drop_host(spec)

    @replying
    async def load_host(self, spec: ServiceSpec) -> None:
        await self._made_backend().load_host(spec)

    @replying
    async def close(self, instance_id: int) -> None:
        """Close the instance; closing one the agent does not hold is done already."""
        instance = self._instances.pop(instance_id, None)
        if instance is not None:
            await instance.close()

    @replying
    async def shutdown(self) -> None:
        """Close every instance and the backend (the broker lets the agent go after this)."""
        instances, self._instances = list(self._instances.values()), {}
        for instance in instances:
            await instance.close()
        if self._backend is not None:
            await self._backend.close()
            self._backend = None
        await self._channels.close()
