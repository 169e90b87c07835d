"""The seam between the GPU manager and whatever actually holds a reward model on GPUs.

The GPU manager (``managers/gpu/manager.py``) owns chunks, residency bookkeeping and LRU eviction. A backend only knows
how to hold one *instance* — one service at one DoP, bound to one chunk of devices — in three states:

* prepared: weights in host memory, nothing on the devices (``prepare``; also the state after ``evict``);
* resident: weights on the devices, ready to answer (``restore``);
* closed (``close``).

The manager calls these one at a time per instance, and ``infer`` only while the instance is resident and the
manager holds its chunk exclusively (at most one action per GPU).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import PlainValidator

from reward_services.options import ServiceOptions
from tangram.core.config_tables import TABLE, Count, Text

#: what a service computes, and so which request body ``infer`` takes (see ``reward_services/requests.py``)
Task = Literal["similarity", "classify", "score", "generate"]
TASKS: tuple[str, ...] = get_args(Task)
#: degrees of parallelism a chunk can have: intervals of 1, 2, 4 or 8 GPUs aligned to their size
LEGAL_DOPS = (1, 2, 4, 8)


def _dops(value: Any) -> tuple[int, ...]:
    if (not isinstance(value, (list, tuple)) or not value or len(set(value)) != len(value)
            or not all(type(d) is int and d in LEGAL_DOPS for d in value)):
        raise ValueError(f"must be a list of distinct degrees of parallelism from {list(LEGAL_DOPS)}")
    return tuple(sorted(value))


@dataclass(frozen=True)
class ServiceSpec:
    """One registered reward service (a ``[gpu.services.NAME]`` table)."""

    __pydantic_config__ = TABLE

    name: str
    backend: Literal["torch", "sglang"]
    model: Text  # torch: a model directory or an installed model package; sglang: --model-path
    task: Task
    dops: Annotated[tuple[int, ...], PlainValidator(_dops)]  # supported degrees of parallelism, ascending
    gpu_memory_mb: Count  # device memory one resident instance needs on each of its GPUs
    host_memory_mb: Count  # host memory one copy of the weights takes
    options: ServiceOptions | None = None  # the backend's settings; None: its defaults


class ServiceError(Exception):
    """An instance operation failed. ``code`` becomes the action's error code.

    Codes: ``prepare_failed``, ``restore_failed``, ``evict_failed``, ``inference_failed``, ``service_unavailable``
    (the process or server behind the instance is gone), ``node_lost`` (the node's agent is gone for good),
    ``bad_input`` (the model refused the request, or a node agent refused it as the REST API would).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


#: codes after which the instance is gone and must be made afresh before it can answer again
GONE = frozenset({"service_unavailable", "node_lost"})


class ServiceInstance(abc.ABC):
    """One service at one DoP on one chunk of devices (``devices``: GPU indices of the node)."""

    def __init__(self, spec: ServiceSpec, devices: tuple[int, ...]) -> None:
        self.spec = spec
        self.devices = devices

    @abc.abstractmethod
    async def prepare(self) -> None:
        """Get ready to restore: weights in host memory, no device memory held. Called once, before anything."""

    @abc.abstractmethod
    async def restore(self) -> None:
        """Copy the weights from host memory to the devices; returns when the instance can answer."""

    @abc.abstractmethod
    async def evict(self) -> None:
        """Free the instance's device memory and keep the host copy; returns only once the memory is free."""

    @abc.abstractmethod
    async def infer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one validated request (see ``requests.py``) while resident."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Free host and device memory and stop any process behind the instance. Idempotent."""

    def describe(self) -> dict[str, Any]:
        """Backend details for ``GET /v1/services`` (a server's URL, a process id, ...)."""
        return {}


class ServiceBackend(abc.ABC):
    """Makes instances on one GPU node."""

    #: True when every instance of a service restores from one shared host copy (the in-process torch worker);
    #: False when each instance keeps its own (each SGLang server process backs up its own weights)
    shares_host_copy: bool = False
    #: True when its services' host copies can go down to a disk tier (one per service: ``shares_host_copy``)
    tiered: bool = False

    @abc.abstractmethod
    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> ServiceInstance:
        """A new, unprepared instance of ``spec`` on ``devices``."""

    def host_copies(self, spec: ServiceSpec, instances: int) -> int:
        """How many host copies of ``spec``'s weights ``instances`` instances keep (for host-memory admission)."""
        return min(instances, 1) if self.shares_host_copy else instances

    async def spill(self, spec: ServiceSpec) -> None:
        """Write ``spec``'s host copy to its disk tier file (after an instance of it is prepared), once at start."""
        raise ServiceError("prepare_failed", f"{spec.name}: {type(self).__name__} has no disk tier")

    async def drop_host(self, spec: ServiceSpec) -> None:
        """Free ``spec``'s host copy (spilled first); no restore may read it until ``load_host``."""
        raise ServiceError("restore_failed", f"{spec.name}: {type(self).__name__} has no disk tier")

    async def load_host(self, spec: ServiceSpec) -> None:
        """Read ``spec``'s host copy back from its disk tier file."""
        raise ServiceError("restore_failed", f"{spec.name}: {type(self).__name__} has no disk tier")

    async def disk_room_mb(self, names: Sequence[str]) -> int:
        """MiB the disk tier can give the files of services ``names``: its free space plus their files from an
        earlier run (rewritten at start); raises ``ServiceError`` when the directory cannot be used."""
        raise ServiceError("prepare_failed", f"{type(self).__name__} has no disk tier")

    async def close(self) -> None:
        """Free what the backend itself holds (instances are closed by the manager first)."""
