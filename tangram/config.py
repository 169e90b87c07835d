"""The one TOML config. Every key has a default that serves on a laptop; bad keys are named in the error."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, PlainValidator, StrictStr

from managers.basic.manager import BasicResourceConfig, with_capacity
from managers.cpu.config import CpuConfig, parse_cpu_config
from managers.gpu.config import GpuConfig, parse_gpu_config
from managers.remote.broker.ray_config import RayConfig
from tangram.core.config_tables import (
    TABLE,
    AutoFlag,
    Count,
    Flag,
    NonNegative,
    PositiveSeconds,
    Seconds,
    Text,
    named_tables,
    table,
)
from tangram.core.errors import ConfigError
from tangram.core.names import NAME
from tangram.parse import Limits
from tangram.sched.profile import SchedulerProfile, refuse_moved
from tangram.sched.tenants import CAP_NAMES, TaskCaps, Tenancy
from tangram.slo.plan import SloPlan
from tangram.tracing import TracingConfig

DEFAULT_DB = "sqlite+aiosqlite:///tangram.db"


SHA256_HEX = re.compile(r"^[0-9a-f]{64}\Z")


def token_hashes(raw: Any) -> tuple[str, ...]:
    """One SHA-256 hex digest or a list of them (two while a token is rotated), lowercased. The error never repeats
    the value, which may be the token itself."""
    values = [raw] if isinstance(raw, str) else raw
    if not isinstance(values, list) or not values:
        raise ValueError("must be a SHA-256 hex digest or a non-empty list of them")
    digests = tuple(value.lower() if isinstance(value, str) else "" for value in values)
    if not all(SHA256_HEX.match(digest) for digest in digests):
        raise ValueError("must be the SHA-256 of a token as 64 hex digits (`tangram token hash` prints it), never "
                         "the token itself")
    return digests


TokenHashes = Annotated[tuple[str, ...], PlainValidator(token_hashes)]


@dataclass(frozen=True)
class AuthConfig:
    """``[auth]``: bearer tokens on the REST API."""

    __pydantic_config__ = TABLE

    #: True: every /v1 route needs a token; False: nothing is checked (development); None ("auto"): on as soon as
    #: a token exists, in this file or in the store (a store that ever held one stays closed)
    required: AutoFlag = None
    #: SHA-256 (hex) of the admin tokens; never the tokens themselves
    admin_token_sha256: TokenHashes = ()
    #: the status page, its history, GET /v1/resources and /metrics answer without a token (aggregate figures only)
    public_status: Flag = True
    #: how often tokens another process made or revoked in the store (``tangram token``) are picked up
    refresh_s: PositiveSeconds = 5.0


@dataclass(frozen=True)
class AccessConfig:
    """Who may call the API and how much each task may ask: ``[auth]``, ``[tasks]`` and ``[tasks.NAME]``."""

    auth: AuthConfig = field(default_factory=AuthConfig)
    #: task -> SHA-256 (hex) of its tokens
    task_tokens: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tenancy: Tenancy = field(default_factory=Tenancy)
    #: task -> its SLO and worst-case step (``[tasks.NAME.slo]``), admitted to the GPU pool at start and on reload
    slo_plans: Mapping[str, SloPlan] = field(default_factory=dict)
    #: the file these were read from, which ``POST /v1/admin/reload`` reads again (None: built-in defaults)
    source: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    __pydantic_config__ = TABLE

    host: StrictStr = "127.0.0.1"
    port: Annotated[int, Field(strict=True, ge=0, le=65535)] = 8300
    max_body_bytes: NonNegative = 8 << 20
    max_batch: NonNegative = 2000
    max_wait_s: Seconds = 300.0
    #: the status page's sampling interval and how much history it keeps
    status_interval_s: PositiveSeconds = 2.0
    status_keep_s: Seconds = 900.0
    #: on SIGTERM, how long running actions may take to finish before they are cancelled
    drain_s: Seconds = 30.0
    #: where clients reach this broker (a standby tells them the leader's); default http://host:port
    advertise_url: Text | None = None
    #: a connection must send a request's whole header within this many seconds of opening, or of its last
    #: answer (so an idle keep-alive connection is closed after it, too); a half-sent header is dropped then
    header_timeout_s: PositiveSeconds = 60.0
    #: a request's body (``Content-Length`` or chunked) must arrive within this many seconds of its header, or the
    #: broker answers 408 and closes the connection (after aiohttp's lingering read, at most 10 s more)
    body_timeout_s: PositiveSeconds = 60.0

    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class SchedulerConfig(SchedulerProfile):
    """``[scheduler]``: the scheduler profile (``tangram/sched/profile.py``), which the simulator takes too, and the
    broker's bounds on what it holds."""

    #: submits beyond get 503
    max_queue: NonNegative = 100_000
    #: finished records stay in memory this long (always in the store)
    retain_s: Seconds = 600.0


def parse_scheduler(raw: Any) -> SchedulerConfig:
    """``[scheduler]``; a key it held before the profile is refused naming where it went."""
    refuse_moved(raw)
    return table(SchedulerConfig, raw, "scheduler")


@dataclass(frozen=True)
class StoreConfig:
    __pydantic_config__ = TABLE

    url: Text = DEFAULT_DB
    #: several brokers share this (PostgreSQL) store: one leads, the others stand by and take over when it dies
    leader_election: Flag = False


def check_store(store: StoreConfig) -> StoreConfig:
    if store.leader_election and not store.url.startswith("postgresql"):
        raise ConfigError("store.leader_election",
                          "needs a PostgreSQL store (store.url = \"postgresql+asyncpg://...\")")
    return store


@dataclass(frozen=True)
class TaskTable(TaskCaps):
    """``[tasks.NAME]``: one task's caps, its tokens and its SLO."""

    token_sha256: TokenHashes = ()
    slo: SloPlan | None = None


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: Limits = field(default_factory=Limits)
    basic: tuple[BasicResourceConfig, ...] = (BasicResourceConfig(name="lease.local", concurrency=64),)
    pools: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    #: authentication and per-task caps: the [auth] and [tasks] sections
    access: AccessConfig = field(default_factory=AccessConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)


#: ``[pools]``: resource = {pool = capacity}
Pools = dict[str, Annotated[dict[str, Count], Field(min_length=1)]]


def _tasks(raw: Any) -> tuple[dict[str, tuple[str, ...]], Tenancy, dict[str, SloPlan]]:
    """``[tasks]``: caps for every task as plain keys, one task's tokens, caps and SLO as a ``[tasks.NAME]`` table."""
    if not isinstance(raw, dict):
        raise ConfigError("tasks", "must be a table")
    per_task = {name: value for name, value in raw.items() if isinstance(value, dict)}
    for name in per_task:
        if not NAME.match(name):
            raise ConfigError(f"tasks.{name}", "is not a valid task name (letters, digits and ._:-/, at most 128)")
    tables = {name: table(TaskTable, value, f"tasks.{name}") for name, value in per_task.items()}
    defaults = table(TaskCaps, {k: v for k, v in raw.items() if k not in per_task}, "tasks")
    return ({name: t.token_sha256 for name, t in tables.items() if t.token_sha256},
            Tenancy(defaults, {name: TaskCaps(*(getattr(t, cap) for cap in CAP_NAMES))
                                      for name, t in tables.items()}),
            {name: t.slo for name, t in tables.items() if t.slo is not None})


def parse_access(raw: Mapping[str, Any]) -> AccessConfig:
    """The ``[auth]`` and ``[tasks]`` sections of a config; a token hash names one task or the admin, never two."""
    auth = table(AuthConfig, raw.get("auth", {}), "auth")
    tokens, tenancy, plans = _tasks(raw.get("tasks", {}))
    owners: dict[str, str] = {}
    for owner, digests in [("auth.admin_token_sha256", auth.admin_token_sha256),
                           *((f"tasks.{task}.token_sha256", d) for task, d in tokens.items())]:
        for digest in digests:
            if digest in owners:
                raise ConfigError(owner, f"a token belongs to one task or to the admin; this one is also in "
                                         f"{owners[digest]}")
            owners[digest] = owner
    return AccessConfig(auth=auth, task_tokens=tokens, tenancy=tenancy, slo_plans=plans)


SECTIONS = ("server", "scheduler", "store", "limits", "basic", "pools", "cpu", "gpu", "ray", "auth", "tasks",
            "tracing")


def parse_config(raw: dict[str, Any]) -> Config:
    for key in raw:
        if key not in SECTIONS:
            raise ConfigError(key, f"unknown section; known sections are {sorted(SECTIONS)}")
    config = with_ray(Config(
        server=table(ServerConfig, raw.get("server", {}), "server"),
        access=parse_access(raw),
        scheduler=parse_scheduler(raw.get("scheduler", {})),
        store=check_store(table(StoreConfig, raw.get("store", {}), "store")),
        limits=table(Limits, raw.get("limits", {}), "limits"),
        pools=table(Pools, raw.get("pools", {}), "pools"),
        cpu=parse_cpu_config(raw.get("cpu", {})),
        gpu=parse_gpu_config(raw.get("gpu", {})),
        tracing=table(TracingConfig, raw.get("tracing", {}), "tracing"),
    ), table(RayConfig, raw.get("ray", {}), "ray"))
    if "basic" in raw:
        config = replace(config, basic=tuple(with_capacity(b) for b in named_tables(BasicResourceConfig,
                                                                                      raw["basic"], "basic")))
    names = ([b.name for b in config.basic] + list(config.pools) + (["cpu"] if config.cpu.enabled else [])
             + (["gpu"] if config.gpu.enabled or config.gpu.nodes else []))
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise ConfigError(duplicate, "resource is declared twice")
    for resource in config.scheduler.queue_order_by_resource:
        if resource not in names:
            raise ConfigError(f"scheduler.queue_order_by_resource.{resource}",
                              f"names no resource of this broker; it has {names}")
    if config.server.status_keep_s < config.server.status_interval_s:
        raise ConfigError("server.status_keep_s", "must be at least server.status_interval_s")
    return config


def with_ray(config: Config, ray: RayConfig) -> Config:
    """``config`` with the ``[ray]`` section ``ray``, given to both managers (their agents share one cluster)."""
    return replace(config, cpu=replace(config.cpu, ray=ray), gpu=replace(config.gpu, ray=ray))


#: what ``$TANGRAM_ADVERTISE_URL`` may be: scheme, host and port, no path
ADVERTISED = re.compile(r"^https?://[^/\s]+/?\Z")
#: environment variables that override the file, so secrets (the database password) stay out of ConfigMaps
STORE_URL_ENV = "TANGRAM_STORE_URL"
CONFIG_ENV = "TANGRAM_CONFIG"
#: SHA-256 (hex, comma-separated) of admin tokens, added to the file's ``[auth] admin_token_sha256``: a deployment's
#: secret names the admin without writing the config file; ``POST /v1/admin/reload`` reads it again with the file
ADMIN_TOKEN_ENV = "TANGRAM_ADMIN_TOKEN_SHA256"
#: ``[server] advertise_url`` for this process: each replica of one config (a Kubernetes pod) has its own address
ADVERTISE_URL_ENV = "TANGRAM_ADVERTISE_URL"


def load_config(path: str | Path | None, environ: Mapping[str, str] = os.environ) -> Config:
    """Read the TOML file (``--config``, else ``$TANGRAM_CONFIG``, else the defaults), then apply
    ``$TANGRAM_STORE_URL`` over ``store.url`` and ``$TANGRAM_ADVERTISE_URL`` over ``server.advertise_url``, and add
    ``$TANGRAM_ADMIN_TOKEN_SHA256`` to the admin hashes (an empty variable counts as unset, as Compose's
    ``${VAR:-}`` leaves it)."""
    path = path or environ.get(CONFIG_ENV) or None
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                raw = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError("--config", f"file {path} does not exist") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError("--config", f"{path} is not valid TOML: {error}") from None
    url = environ.get(STORE_URL_ENV)
    if url:  # before the file is checked: its leader election is checked against the URL it will use
        store = raw.get("store", {})
        raw = {**raw, "store": {**store, "url": url} if isinstance(store, dict) else store}
    config = parse_config(raw)
    if path is not None:
        config = replace(config, access=replace(config.access, source=str(path)))
    advertised = environ.get(ADVERTISE_URL_ENV)
    if advertised:
        if not ADVERTISED.match(advertised):
            raise ConfigError(ADVERTISE_URL_ENV, f"must be an http(s) URL clients reach this broker at, not "
                                                 f"{advertised!r}")
        config = replace(config, server=replace(config.server, advertise_url=advertised))
    admins = environ.get(ADMIN_TOKEN_ENV, "").strip()
    if admins:
        access = config.access
        try:
            digests = token_hashes([item.strip() for item in admins.split(",")])
        except ValueError as error:
            raise ConfigError(ADMIN_TOKEN_ENV, str(error)) from None
        for task, task_digests in access.task_tokens.items():
            if set(digests) & set(task_digests):
                raise ConfigError(ADMIN_TOKEN_ENV, f"a token belongs to one task or to the admin; this one is also "
                                                   f"in tasks.{task}.token_sha256")
        merged = tuple(dict.fromkeys(access.auth.admin_token_sha256 + digests))  # the file's first, each once
        config = replace(config, access=replace(access, auth=replace(access.auth, admin_token_sha256=merged)))
    return config
