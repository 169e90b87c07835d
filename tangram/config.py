"""The one TOML config. Every key has a default that serves on a laptop; bad keys are named in the error."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from managers.basic import BasicResourceConfig, UpstreamConfig
from managers.cpu_config import CpuConfig, parse_cpu_config
from managers.gpu_config import GpuConfig, parse_gpu_config
from tangram.errors import ConfigError
from tangram.parse import Limits

DEFAULT_DB = "sqlite+aiosqlite:///tangram.db"


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


def parse_config(raw: dict[str, Any]) -> Config:
    sections = {"server", "scheduler", "store", "limits", "basic", "pools", "cpu", "gpu"}
    for key in raw:
        if key not in sections:
            raise ConfigError(key, f"unknown section; known sections are {sorted(sections)}")
    config = Config(
        server=_section(ServerConfig, raw.get("server", {}), "server"),
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


def load_config(path: str | Path | None, environ: Mapping[str, str] = os.environ) -> Config:
    """Read the TOML file (``--config``, else ``$TANGRAM_CONFIG``, else the defaults), then apply
    ``$TANGRAM_STORE_URL`` over ``store.url``."""
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
    url = environ.get(STORE_URL_ENV)
    if url:
        config = replace(config, store=StoreConfig(url=url))
    return config
