"""The one TOML config. Every key has a default that serves on a laptop; bad keys are named in the error."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from managers.basic import BasicResourceConfig, UpstreamConfig
from managers.cpu_config import CpuConfig, parse_cpu_config
from managers.gpu_config import GpuConfig, parse_gpu_config
from tangram.core.errors import ConfigError
from tangram.core.names import NAME
from tangram.parse import Limits
from tangram.tenants import CAP_NAMES, TaskCaps, Tenancy

DEFAULT_DB = "sqlite+aiosqlite:///tangram.db"


SHA256_HEX = re.compile(r"^[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class AuthConfig:
    """``[auth]``: bearer tokens on the REST API."""

    #: True: every /v1 route needs a token; False: nothing is checked (development); None ("auto"): on as soon as
    #: a token exists, in this file or in the store (a store that ever held one stays closed)
    required: bool | None = None
    #: SHA-256 (hex) of the admin tokens; never the tokens themselves
    admin_token_sha256: tuple[str, ...] = ()
    #: the status page, its history, GET /v1/resources and /metrics answer without a token (aggregate figures only)
    public_status: bool = True
    #: how often tokens another process made or revoked in the store (``tangram token``) are picked up
    refresh_s: float = 5.0


@dataclass(frozen=True)
class AccessConfig:
    """Who may call the API and how much each task may ask: ``[auth]``, ``[tasks]`` and ``[tasks.NAME]``."""

    auth: AuthConfig = field(default_factory=AuthConfig)
    #: task -> SHA-256 (hex) of its tokens
    task_tokens: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tenancy: Tenancy = field(default_factory=Tenancy)
    #: the file these were read from, which ``POST /v1/admin/reload`` reads again (None: built-in defaults)
    source: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8300
    max_body_bytes: int = 8 << 20
    max_batch: int = 2000
    max_wait_s: float = 300.0
    #: the status page's sampling interval and how much history it keeps
    status_interval_s: float = 2.0
    status_keep_s: float = 900.0
    #: on SIGTERM, how long running actions may take to finish before they are cancelled
    drain_s: float = 30.0


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "fcfs"
    depth: int = 2
    horizon: int = 64
    default_duration_s: float = 1.0
    ewma_alpha: float = 0.2
    max_queue: int = 100_000
    retain_s: float = 600.0


@dataclass(frozen=True)
class StoreConfig:
    url: str = DEFAULT_DB


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: Limits = field(default_factory=Limits)
    basic: tuple[BasicResourceConfig, ...] = (BasicResourceConfig(name="lease.local", concurrency=64),)
    pools: dict[str, dict[str, int]] = field(default_factory=dict)
    cpu: CpuConfig = field(default_factory=lambda: parse_cpu_config({}))
    gpu: GpuConfig = field(default_factory=lambda: parse_gpu_config({}))
    #: authentication and per-task caps: the [auth] and [tasks] sections
    access: AccessConfig = field(default_factory=AccessConfig)


def _section(cls: type, raw: Any, where: str) -> Any:
    """Build a flat dataclass whose fields all have defaults from a TOML table, checking names and types."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "must be a table")
    defaults = cls()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if not hasattr(defaults, key):
            raise ConfigError(f"{where}.{key}", f"unknown key; known keys are {sorted(f.name for f in fields(cls))}")
        default = getattr(defaults, key)
        if isinstance(default, float) and type(value) is int:
            value = float(value)
        if type(value) is not type(default):
            raise ConfigError(f"{where}.{key}", f"must be of type {type(default).__name__}")
        if isinstance(value, (int, float)) and value < 0:
            raise ConfigError(f"{where}.{key}", "must not be negative")
        values[key] = value
    return cls(**values)


def _basic(name: str, raw: Any) -> BasicResourceConfig:
    where = f"basic.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(where, "must be a table")
    raw = dict(raw)
    upstream = None
    if "upstream" in raw:
        up = raw.pop("upstream")
        if not isinstance(up, dict) or not isinstance(up.get("base_url"), str):
            raise ConfigError(f"{where}.upstream.base_url", "is required and must be a string URL")
        upstream = _section_with_required(UpstreamConfig, up, f"{where}.upstream")
        if not upstream.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.upstream.base_url", "must start with http:// or https://")
    resource = _section_with_required(BasicResourceConfig, {"name": name, **raw}, where)
    if resource.concurrency is None and resource.quota is None:
        raise ConfigError(where, "set concurrency, quota or both")
    for key in ("concurrency", "quota"):
        value = getattr(resource, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}.{key}", "must be a positive integer")
    return BasicResourceConfig(**{**resource.__dict__, "upstream": upstream})


def _section_with_required(cls: type, raw: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{where}.{key}", f"unknown key; known keys are {sorted(known)}")
    try:
        return cls(**raw)
    except TypeError as error:
        raise ConfigError(where, str(error)) from None


def _pools(raw: Any) -> dict[str, dict[str, int]]:
    if not isinstance(raw, dict):
        raise ConfigError("pools", "must be a table of resource = {pool = capacity}")
    pools: dict[str, dict[str, int]] = {}
    for resource, table in raw.items():
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"pools.{resource}", "must be a non-empty table of pool = capacity")
        for pool, capacity in table.items():
            if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
                raise ConfigError(f"pools.{resource}.{pool}", "must be a positive integer")
        pools[resource] = dict(table)
    return pools


def _token_hashes(raw: Any, where: str) -> tuple[str, ...]:
    """One SHA-256 hex digest or a list of them (two while a token is rotated), lowercased."""
    values = [raw] if isinstance(raw, str) else raw
    if not isinstance(values, list) or not values:
        raise ConfigError(where, "must be a SHA-256 hex digest or a non-empty list of them")
    digests = []
    for value in values:
        digest = value.lower() if isinstance(value, str) else None
        if digest is None or not SHA256_HEX.match(digest):
            raise ConfigError(where, "must be the SHA-256 of a token as 64 hex digits (`tangram token hash` prints "
                                     "it), never the token itself")
        digests.append(digest)
    return tuple(digests)


def _auth(raw: Any) -> AuthConfig:
    if not isinstance(raw, dict):
        raise ConfigError("auth", "must be a table")
    raw = dict(raw)
    required = raw.pop("required", "auto")
    if required not in (True, False, "auto"):
        raise ConfigError("auth.required", 'must be true, false or "auto"')
    admins = _token_hashes(raw.pop("admin_token_sha256"), "auth.admin_token_sha256") \
        if "admin_token_sha256" in raw else ()
    rest = _section(AuthConfig, raw, "auth")
    if rest.refresh_s <= 0:
        raise ConfigError("auth.refresh_s", "must be a positive number of seconds")
    return replace(rest, required=None if required == "auto" else required, admin_token_sha256=admins)


def _caps(raw: dict[str, Any], where: str) -> TaskCaps:
    for key, value in raw.items():
        if key not in CAP_NAMES:
            raise ConfigError(f"{where}.{key}", f"unknown key; known keys are {sorted(CAP_NAMES)}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}.{key}", "must be a non-negative integer (0 stops the task)")
    return TaskCaps(**raw)


def _tasks(raw: Any) -> tuple[dict[str, tuple[str, ...]], Tenancy]:
    """``[tasks]``: caps for every task as plain keys, one task's tokens and caps as a ``[tasks.NAME]`` table."""
    if not isinstance(raw, dict):
        raise ConfigError("tasks", "must be a table")
    tokens: dict[str, tuple[str, ...]] = {}
    per_task: dict[str, TaskCaps] = {}
    for name, value in raw.items():
        if not isinstance(value, dict):
            continue
        where = f"tasks.{name}"
        if not NAME.match(name):
            raise ConfigError(where, "is not a valid task name (letters, digits and ._:-/, at most 128)")
        value = dict(value)
        if "token_sha256" in value:
            tokens[name] = _token_hashes(value.pop("token_sha256"), f"{where}.token_sha256")
        per_task[name] = _caps(value, where)
    defaults = _caps({k: v for k, v in raw.items() if not isinstance(v, dict)}, "tasks")
    return tokens, Tenancy(defaults, per_task)


def parse_access(raw: Mapping[str, Any]) -> AccessConfig:
    """The ``[auth]`` and ``[tasks]`` sections of a config; a token hash names one task or the admin, never two."""
    auth = _auth(raw.get("auth", {}))
    tokens, tenancy = _tasks(raw.get("tasks", {}))
    owners: dict[str, str] = {}
    for owner, digests in [("auth.admin_token_sha256", auth.admin_token_sha256),
                           *((f"tasks.{task}.token_sha256", d) for task, d in tokens.items())]:
        for digest in digests:
            if digest in owners:
                raise ConfigError(owner, f"a token belongs to one task or to the admin; this one is also in "
                                         f"{owners[digest]}")
            owners[digest] = owner
    return AccessConfig(auth=auth, task_tokens=tokens, tenancy=tenancy)


def parse_config(raw: dict[str, Any]) -> Config:
    sections = {"server", "scheduler", "store", "limits", "basic", "pools", "cpu", "gpu", "auth", "tasks"}
    for key in raw:
        if key not in sections:
            raise ConfigError(key, f"unknown section; known sections are {sorted(sections)}")
    config = Config(
        server=_section(ServerConfig, raw.get("server", {}), "server"),
        access=parse_access(raw),
        scheduler=_section(SchedulerConfig, raw.get("scheduler", {}), "scheduler"),
        store=_section(StoreConfig, raw.get("store", {}), "store"),
        limits=_section(Limits, raw.get("limits", {}), "limits"),
        pools=_pools(raw.get("pools", {})),
        cpu=parse_cpu_config(raw.get("cpu", {})),
        gpu=parse_gpu_config(raw.get("gpu", {})),
    )
    if "basic" in raw:
        if not isinstance(raw["basic"], dict):
            raise ConfigError("basic", "must be a table of resource name = settings")
        config = replace(config, basic=tuple(_basic(n, t) for n, t in raw["basic"].items()))
    names = ([b.name for b in config.basic] + list(config.pools) + (["cpu"] if config.cpu.enabled else [])
             + (["gpu"] if config.gpu.enabled else []))
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise ConfigError(duplicate, "resource is declared twice")
    if config.server.status_interval_s <= 0:
        raise ConfigError("server.status_interval_s", "must be a positive number of seconds")
    if config.server.status_keep_s < config.server.status_interval_s:
        raise ConfigError("server.status_keep_s", "must be at least server.status_interval_s")
    if config.scheduler.depth < 1:
        raise ConfigError("scheduler.depth", "must be at least 1")
    if not 0 < config.scheduler.ewma_alpha <= 1:
        raise ConfigError("scheduler.ewma_alpha", "must be in (0, 1]")
    return config


#: environment variables that override the file, so secrets (the database password) stay out of ConfigMaps
STORE_URL_ENV = "TANGRAM_STORE_URL"
CONFIG_ENV = "TANGRAM_CONFIG"
#: SHA-256 (hex, comma-separated) of admin tokens, added to the file's ``[auth] admin_token_sha256``: a deployment's
#: secret names the admin without writing the config file; ``POST /v1/admin/reload`` reads it again with the file
ADMIN_TOKEN_ENV = "TANGRAM_ADMIN_TOKEN_SHA256"


def load_config(path: str | Path | None, environ: Mapping[str, str] = os.environ) -> Config:
    """Read the TOML file (``--config``, else ``$TANGRAM_CONFIG``, else the defaults), then apply
    ``$TANGRAM_STORE_URL`` over ``store.url`` and add ``$TANGRAM_ADMIN_TOKEN_SHA256`` to the admin hashes (an
    empty variable counts as unset, as Compose's ``${VAR:-}`` leaves it)."""
    path = path or environ.get(CONFIG_ENV) or None
    if path is None:
        config = Config()
    else:
        try:
            with open(path, "rb") as handle:
                raw = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError("--config", f"file {path} does not exist") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError("--config", f"{path} is not valid TOML: {error}") from None
        config = parse_config(raw)
        config = replace(config, access=replace(config.access, source=str(path)))
    url = environ.get(STORE_URL_ENV)
    if url:
        config = replace(config, store=StoreConfig(url=url))
    admins = environ.get(ADMIN_TOKEN_ENV, "").strip()
    if admins:
        access = config.access
        digests = _token_hashes([item.strip() for item in admins.split(",")], ADMIN_TOKEN_ENV)
        for task, task_digests in access.task_tokens.items():
            if set(digests) & set(task_digests):
                raise ConfigError(ADMIN_TOKEN_ENV, f"a token belongs to one task or to the admin; this one is also "
                                                   f"in tasks.{task}.token_sha256")
        merged = tuple(dict.fromkeys(access.auth.admin_token_sha256 + digests))  # the file's first, each once
        config = replace(config, access=replace(access, auth=replace(access.auth, admin_token_sha256=merged)))
    return config
