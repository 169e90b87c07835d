"""Warm sandboxes (issue 17): a node keeps a few sandboxes of each configured kind (the default image and memory,
and others by image and memory: issue 38) started and frozen, so a new trajectory's first ``exec`` claims one
instead of waiting for a container to be created and its executor to start (0.3-0.6 s). Creating goes through a per-node rate limit, cold creates and refills alike, so a burst of new
trajectories queues at the engine's pace instead of failing on it (agent-sandbox and ROCK users report both
problems: kubernetes-sigs/agent-sandbox#34, alibaba/ROCK#1310).

The pool is the backend's business: it knows how to hand a warm sandbox a trajectory's identity and files
(``sandboxes/docker.py``). A warm sandbox holds no cores and is not counted in the node's memory reservations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Generic, TypeVar

from sandboxes.backend import Sandbox, SandboxError, SandboxSpec

log = logging.getLogger("tangram.cpu")

S = TypeVar("S", bound=Sandbox)

#: after a failed refill (the engine is down, the image is gone), wait this long before the next
REFILL_BACKOFF_S = 5.0


class CreateRate:
    """At most ``per_s`` sandbox creations start per second, after a first burst of ``per_s``; the rest wait their
    turn, in order."""

    def __init__(self, per_s: float) -> None:
        self._per_s = per_s
        self._tokens = per_s
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def turn(self) -> None:
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self._per_s, self._tokens + (now - self._stamp) * self._per_s)
            self._stamp = now
            if self._tokens < 1:
                await asyncio.sleep((1 - self._tokens) / self._per_s)
                self._stamp = time.monotonic()
                self._tokens = 1.0
            self._tokens -= 1


def _kind(spec: SandboxSpec) -> tuple[object, ...]:
    """What a warm sandbox must share with a spec to become its sandbox: all but its identity and files (its egress
    too: the relay to a proxy starts with the sandbox)."""
    return (spec.image, spec.memory_mb, spec.pids_limit, spec.read_only_root, spec.user, spec.disk_mb, spec.broker_id,
            spec.egress)


class WarmPool(Generic[S]):
    """Up to ``size`` idle sandboxes made from ``template``, refilled in the background as they are claimed."""

    def __init__(self, template: SandboxSpec, size: int, rate: CreateRate,
                 create: Callable[[SandboxSpec], Awaitable[S]]) -> None:
        """``create(spec)`` makes one sandbox (its rate turn already taken)."""
        self.template = template
        self.size = size
        self._rate = rate
        self._create = create
        self._idle: dict[str, S] = {}  # by environment id, oldest first
        self._making: tuple[str, asyncio.Future[S]] | None = None  # (environment id, its creation)
        self._wanted = asyncio.Event()
        self._refiller: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._idle)

    def start(self) -> None:
        """Fill the pool from now on (once)."""
        if self._refiller is None:
            self._wanted.set()
            self._refiller = asyncio.create_task(self._refill(), name="tangram-warm-sandboxes")

    def owns(self, env_id: str) -> bool:
        """Whether ``env_id`` is one of the pool's sandboxes, idle or being made (not a leftover to adopt)."""
        return env_id in self._idle or (self._making is not None and env_id == self._making[0])

    def fits(self, spec: SandboxSpec) -> bool:
        """A warm sandbox can become ``spec``'s: the same image, limits and broker (files come at the claim)."""
        return _kind(spec) == _kind(self.template)

    def claim(self, spec: SandboxSpec) -> S | None:
        """An idle warm sandbox for ``spec`` (the caller gives it its identity), or None."""
        if not self._idle or not self.fits(spec):
            return None
        self._wanted.set()
        return self._idle.pop(next(iter(self._idle)))

    async def _refill(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            while len(self._idle) < self.size:
                await self._rate.turn()
                spec = replace(self.template, env_id=f"warm-{uuid.uuid4().hex[:16]}", created_at=time.time(),
                               warm=True)
                making = asyncio.ensure_future(self._create(spec))
                self._making = (spec.env_id, making)
                try:
                    self._idle[spec.env_id] = await asyncio.shield(making)  # ``close`` removes one cut short
                except SandboxError as error:
                    log.warning("warm sandbox not made (%s); trying again in %.0f s", error.message,
                                REFILL_BACKOFF_S)
                    await asyncio.sleep(REFILL_BACKOFF_S)
                self._making = None

    async def close(self) -> None:
        """Stop refilling and remove the idle sandboxes."""
        if self._refiller is not None:
            self._refiller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refiller
        idle, self._idle = list(self._idle.values()), {}
        if self._making is not None:  # a creation the cancelled refill was waiting for
            with contextlib.suppress(SandboxError):
                idle.append(await self._making[1])
            self._making = None
        await asyncio.gather(*(sandbox.destroy() for sandbox in idle), return_exceptions=True)


class WarmPools(Generic[S]):
    """A node's warm pools, one per kind of sandbox it keeps warm (issue 38: per image and memory, as configured),
    refilled under one create rate."""

    def __init__(self, kinds: Sequence[tuple[SandboxSpec, int]], rate: CreateRate,
                 create: Callable[[SandboxSpec], Awaitable[S]]) -> None:
        """``kinds``: each pool's template and size."""
        self.pools = [WarmPool(template, size, rate, create) for template, size in kinds if size]

    def __len__(self) -> int:
        return sum(len(pool) for pool in self.pools)

    def start(self) -> None:
        for pool in self.pools:
            pool.start()

    def owns(self, env_id: str) -> bool:
        return any(pool.owns(env_id) for pool in self.pools)

    def claim(self, spec: SandboxSpec) -> S | None:
        """An idle warm sandbox of the pool that fits ``spec``, or None."""
        return next((sandbox for pool in self.pools if (sandbox := pool.claim(spec)) is not None), None)

    def describe(self) -> list[dict[str, Any]]:
        return [{"image": pool.template.image, "memory_mb": pool.template.memory_mb, "size": pool.size,
                 "idle": len(pool)} for pool in self.pools]

    async def close(self) -> None:
        await asyncio.gather(*(pool.close() for pool in self.pools))
