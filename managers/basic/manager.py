"""The Basic resource manager (§5.1): non-scalable external resources under concurrency and quota limits.

Each resource (``api.search``, ``lease.gpu_hours``, ...) is one pool, ``default``, limited by a concurrency cap
(units held at once), a sliding-window quota (units granted per period) or both. Two consumption patterns:

* ``api`` actions are proxied to the resource's upstream; retries take fresh quota units, so the upstream never
  sees more calls than the quota allows, while the concurrency unit is kept for the whole action;
* ``lease`` actions grant units the client holds (``Outcome.hold``) until the broker releases them, on the
  client's DELETE or when ``expired_leases`` reports the TTL passed.

Quota units are spent by time, not returned: ``release`` gives back concurrency only.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Annotated

import aiohttp
from pydantic import Field, TypeAdapter

from managers.basic.quota import QuotaWindow
from managers.basic.upstream import ApiSpec, Upstream, UpstreamConfig, validate_spec
from managers.basic.upstream_metrics import UpstreamMetrics
from tangram.core.action import Action, Kind
from tangram.core.config_tables import TABLE, Count, PositiveSeconds, table
from tangram.core.errors import ConfigError, Unprocessable
from tangram.core.schema import Schema, parse
from tangram.core.seam import Allocation, CyclePlugins, Fit, Outcome, PoolStatus, ResourceManager

__all__ = ["BasicManager", "BasicResourceConfig", "UpstreamConfig"]

POOL = "default"


class LeaseSpec(Schema):
    """A lease action's ``spec``: how long the units are held before they come back on their own."""

    ttl_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="seconds; at most (and by default) the smallest lease_ttl_s of its resources")


LEASE_SPEC = TypeAdapter(LeaseSpec)


@dataclass(frozen=True)
class BasicResourceConfig:
    """``[basic.NAME]``: a counted resource; ``api`` actions on it go to its upstream."""

    __pydantic_config__ = TABLE

    name: str  # e.g. "api.search" (resource names are like "api.<name>" or "lease.<name>")
    concurrency: Count | None = None  # max units in use at once
    quota: Count | None = None  # max units granted per period (sliding window)
    period_s: PositiveSeconds = 60.0
    upstream: UpstreamConfig | None = None  # required for `api` actions on this resource
    lease_ttl_s: PositiveSeconds = 300.0  # default and maximum TTL of a lease on this resource


class _Resource:
    """Live state of one resource: units held now and the quota window."""

    __slots__ = ("config", "held", "largest", "leases", "upstream", "window")

    def __init__(self, config: BasicResourceConfig, clock: Callable[[], float], metrics: UpstreamMetrics) -> None:
        self.config = config
        self.window = None if config.quota is None else QuotaWindow(config.quota, config.period_s, clock)
        self.upstream = None if config.upstream is None else Upstream(config.upstream, config.name, metrics)
        self.held = 0
        self.leases = 0
        #: the most units one action could ever get: the tighter of the two limits (asked at every submit)
        self.largest = min(n for n in (config.concurrency, config.quota) if n is not None)

    @property
    def concurrency_free(self) -> float:
        limit = self.config.concurrency
        return math.inf if limit is None else limit - self.held

    def quota_free(self, now: float) -> float:
        return math.inf if self.window is None else self.window.available(now)


class BasicFit(Fit):
    """Free units per resource as ``(concurrency room, quota room)``, snapshotted once per pass.

    A refusal for lack of quota is written to ``quota_short`` (resource -> smallest refused demand): quota comes
    back only with time, so the manager turns it into a wake-up time in ``next_change_in``.
    """

    __slots__ = ("_added", "_concurrency", "_placed", "_quota", "_quota_short")

    def __init__(self, concurrency: dict[str, float], quota: dict[str, float], quota_short: dict[str, int]) -> None:
        self._concurrency = concurrency
        self._quota = quota
        self._added = dict.fromkeys(concurrency, 0)
        self._placed: dict[str, dict[str, int]] = {}
        self._quota_short = quota_short

    def try_add(self, action: Action, units: Mapping[str, int]) -> bool:
        ok = True
        for resource, n in units.items():
            need = self._added[resource] + n
            if need > self._quota[resource]:
                short = self._quota_short
                short[resource] = min(n, short.get(resource, n))
                ok = False
            if need > self._concurrency[resource]:
                ok = False
        if not ok:
            return False
        for resource, n in units.items():
            self._added[resource] += n
        self._placed[action.id] = dict(units)
        return True

    def remove(self, action: Action) -> None:
        for resource, n in self._placed.pop(action.id).items():
            self._added[resource] -= n

    def pool_of(self, action: Action, resource: str) -> str:
        return POOL

    def free_before(self, resource: str, pool: str) -> int:
        return int(min(self._concurrency[resource], self._quota[resource]))

    def pools(self, resource: str) -> tuple[str, ...]:
        return (POOL,)


class BasicManager(ResourceManager[None]):
    """Concurrency and quota limits per resource; proxies ``api`` actions and grants ``lease`` actions."""

    name = "basic"
    kinds = frozenset({Kind.API, Kind.LEASE})
    spec_types = MappingProxyType({Kind.API: ApiSpec, Kind.LEASE: LeaseSpec})

    def __init__(self, resources: list[BasicResourceConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._res: dict[str, _Resource] = {}
        self._upstream_metrics = UpstreamMetrics()
        for config in resources:
            config = checked(config)
            if config.name in self._res:
                raise ConfigError(f"basic.{config.name}", "resource defined twice")
            self._res[config.name] = _Resource(config, clock, self._upstream_metrics)
        # a resource has a concurrency, a quota or both (checked above): its capacity is the first it has
        self._capacity: dict[str, int] = {name: r.config.concurrency or r.config.quota or 0
                                          for name, r in self._res.items()}
        self._quota_short: dict[str, int] = {}
        self._leases: dict[str, float] = {}  # action id -> expiry
        self._lease_heap: list[tuple[float, str]] = []  # (expiry, action id); stale entries skipped lazily
        self._session: aiohttp.ClientSession | None = None

    # -- capacity -----------------------------------------------------------------------------------------

    @property
    def resources(self) -> Mapping[str, int]:
        return self._capacity

    def largest_pool(self, resource: str) -> int:
        return self._res[resource].largest

    def fit(self) -> BasicFit:
        now = self._clock()
        self._quota_short = {}
        concurrency = {name: r.concurrency_free for name, r in self._res.items()}
        quota = {name: r.quota_free(now) for name, r in self._res.items()}
        return BasicFit(concurrency, quota, self._quota_short)

    def allocate(self, action: Action, units: Mapping[str, int], pools: Mapping[str, str]) -> Allocation[None]:
        now = self._clock()
        for resource, n in units.items():
            r = self._res[resource]
            if n > r.concurrency_free or n > r.quota_free(now):
                raise RuntimeError(f"over-allocation of {resource}: scheduler and manager disagree")
        for resource, n in units.items():
            r = self._res[resource]
            r.held += n
            if r.window is not None:
                r.window.take(n, now)
        return _allocation(action.id, units)

    def release(self, allocation: Allocation[None]) -> None:
        if allocation.released:
            return
        allocation.released = True
        for resource, n in allocation.units.items():
            self._res[resource].held -= n
        if self._leases.pop(allocation.action_id, None) is not None:
            for resource in allocation.units:
                self._res[resource].leases -= 1

    # -- validation ---------------------------------------------------------------------------------------

    def validate(self, action: Action) -> None:
        for resource, demand in action.demands.items():
            r = self._res.get(resource)
            if r is not None and demand.min > r.largest:
                raise Unprocessable(f"demand.{resource}",
                                    f"minimum {demand.min} exceeds what {resource} can ever grant ({r.largest})")
        if action.kind not in self.kinds:
            return
        foreign = sorted(set(action.demands) - set(self._res))
        if foreign:
            raise Unprocessable(f"demand.{foreign[0]}", f"{action.kind.value} actions may only demand basic "
                                                        f"resources ({sorted(self._res)})")
        if not action.demands:
            raise Unprocessable("demand", f"{action.kind.value} actions must demand at least one basic resource")
        if action.kind is Kind.API:
            self._upstream_resource(action)
            validate_spec(action.spec)
        else:
            self._lease_ttl(action)

    def _upstream_resource(self, action: Action) -> _Resource:
        """The one demanded resource with an upstream: it names where the call goes."""
        routed = [name for name in action.demands if self._res[name].upstream is not None]
        if len(routed) != 1:
            with_upstream = sorted(n for n, r in self._res.items() if r.upstream is not None)
            raise Unprocessable("demand", f"an api action must demand exactly one resource with an upstream "
                                          f"(one of {with_upstream}), got {sorted(routed)}")
        return self._res[routed[0]]

    def _lease_ttl(self, action: Action) -> float:
        """The requested TTL, bounded by (and defaulting to) the smallest ``lease_ttl_s`` among its resources."""
        ceiling = min(self._res[name].config.lease_ttl_s for name in action.demands)
        if not isinstance(action.parsed_spec, LeaseSpec):  # parsed at submit; kept for the grant
            action.parsed_spec = parse(LEASE_SPEC, action.spec, "spec")
        ttl = action.parsed_spec.ttl_s
        if ttl is not None and ttl > ceiling:
            raise Unprocessable("spec.ttl_s", f"must be a number of seconds in (0, {ceiling}]")
        return ceiling if ttl is None else ttl

    # -- execution ----------------------------------------------------------------------------------------

    async def execute(self, action: Action, allocation: Allocation[None]) -> Outcome:
        """Proxy an ``api`` action upstream (a ``lease`` is granted at once: ``grant``)."""
        if action.kind is Kind.API:
            return await self._proxy(action, allocation)
        raise NotImplementedError(f"{self.name} does not execute {action.kind.value} actions")

    async def _proxy(self, action: Action, allocation: Allocation[None]) -> Outcome:
        if self._session is None:
            raise RuntimeError("BasicManager.start() was not awaited")
        upstream = self._upstream_resource(action).upstream
        assert upstream is not None

        async def before_retry() -> None:
            await self._take_quota(allocation.units)

        return Outcome(await upstream.call(self._session, action.spec, before_retry))

    async def _take_quota(self, units: Mapping[str, int]) -> None:
        """Take ``units`` again from every quota-limited resource, waiting until all have room at once."""
        windows = [(w, n) for name, n in units.items() if (w := self._res[name].window) is not None]
        while True:
            now = self._clock()
            wait = max((w.seconds_until(n, now) for w, n in windows), default=0.0)
            if wait <= 0:
                for w, n in windows:
                    w.take(n, now)
                return
            await asyncio.sleep(wait)

    def grant(self, action: Action, allocation: Allocation[None]) -> Outcome:
        ttl = self._lease_ttl(action)
        # the grant is the parsed spec's last reader; a held lease may stay in memory for its whole TTL, and the
        # model (an instance and its fields-set, both tracked by the garbage collector) would be scanned by every
        # full collection meanwhile. A later reader parses ``action.spec`` again.
        action.parsed_spec = None
        self._hold_lease(allocation, ttl)
        return Outcome({"lease_id": action.id, "expires_in_s": ttl, "units": dict(allocation.units)}, hold=True)

    def _hold_lease(self, allocation: Allocation[None], ttl_s: float) -> None:
        expiry = self._clock() + ttl_s
        self._leases[allocation.action_id] = expiry
        heapq.heappush(self._lease_heap, (expiry, allocation.action_id))
        for resource in allocation.units:
            self._res[resource].leases += 1

    def longest_lease_s(self) -> float:
        return max((r.config.lease_ttl_s for r in self._res.values()), default=0.0)

    def regrant(self, action: Action, remaining_s: float) -> Allocation[None] | None:
        """Hold a lease a previous process granted for the rest of its TTL. Its units count as held even if the
        config shrank meanwhile; its quota is not taken again (the quota windows of a new process start empty)."""
        if not action.units or any(name not in self._res for name in action.units):
            return None
        for resource, n in action.units.items():
            self._res[resource].held += n
        allocation = _allocation(action.id, action.units)
        self._hold_lease(allocation, remaining_s)
        return allocation

    # -- time-driven changes ------------------------------------------------------------------------------

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Ids of leases whose TTL has passed and that are not released yet; the broker releases them.

        Reported again on every call until released, so a broker that misses one retries it next time.
        """
        now = self._clock() if now is None else now
        heap = self._lease_heap
        expired: dict[str, float] = {}
        below = [0] if heap else []  # the heap's entries due by now form a subtree at its root: walk only that
        while below:
            at = below.pop()
            expiry, action_id = heap[at]
            if expiry > now:
                continue
            if self._leases.get(action_id) == expiry:  # else released, or held again with another expiry
                expired[action_id] = expiry
            below.extend(child for child in (2 * at + 1, 2 * at + 2) if child < len(heap))
        return [action_id for _, action_id in sorted((at, action_id) for action_id, at in expired.items())]

    def plugins(self) -> CyclePlugins:
        return CyclePlugins(next_change_in=self.next_change_in, metrics=self._upstream_metrics.register)

    def next_change_in(self) -> float | None:
        """Seconds until the earliest lease expiry, or until a demand refused for quota in the last pass fits."""
        now = self._clock()
        waits = [w for name, n in self._quota_short.items()
                 if (window := self._res[name].window) is not None
                 and (w := window.seconds_until(n, now)) != math.inf]
        heap = self._lease_heap
        while heap and heap[0][1] not in self._leases:  # released leases: drop their stale entries
            heapq.heappop(heap)
        if heap:
            waits.append(max(0.0, heap[0][0] - now))
        return min(waits, default=None)

    # -- status and lifecycle -----------------------------------------------------------------------------

    def status(self) -> list[PoolStatus]:
        now = self._clock()
        rows = []
        for name, r in self._res.items():
            used = 0 if r.window is None else r.window.used(now)
            in_use = r.held if r.config.concurrency is not None else used
            rows.append(PoolStatus(name, POOL, self._capacity[name], in_use, extra={
                "concurrency": r.config.concurrency, "quota": r.config.quota, "period_s": r.config.period_s,
                "quota_used_in_window": used, "held": r.held, "leases": r.leases}))
        return rows

    async def start(self) -> None:
        if self._session is None:
            # No connection cap (the scheduler enforces concurrency) and no cookie jar: actions of different
            # trajectories share this session and must not see each other's cookies.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _allocation(action_id: str, units: Mapping[str, int]) -> Allocation[None]:
    return Allocation(action_id, dict(units), dict.fromkeys(units, POOL), placement={"resource": dict(units)})


def checked(config: BasicResourceConfig) -> BasicResourceConfig:
    """``config`` (built in code) validated as its TOML table would be; the ``ConfigError`` names the key
    (``basic.<resource>.<key>``) of the first bad setting."""
    return with_capacity(table(BasicResourceConfig, asdict(config), f"basic.{config.name}"))


def with_capacity(config: BasicResourceConfig) -> BasicResourceConfig:
    """A validated ``config`` that sets a concurrency, a quota or both (its capacity is the first it has)."""
    if config.concurrency is None and config.quota is None:
        raise ConfigError(f"basic.{config.name}.concurrency", "set concurrency, quota or both")
    return config
