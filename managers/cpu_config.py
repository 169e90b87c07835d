"""Configuration of the CPU manager: its nodes (Docker engines or this host's processes) and sandbox defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import psutil

from managers.config_checks import check_table, int_limits, positive_int
from managers.exec_spec import ExecLimits
from sandboxes.cgroup import parse_cpu_list
from sandboxes.image import DEFAULT_IMAGE
from tangram.core.errors import ConfigError

BACKENDS = ("auto", "docker", "local")
UNIX_PATH_MAX = 107


@dataclass(frozen=True)
class CpuNodeConfig:
    """One node. ``backend = "auto"`` uses the local Docker engine when it answers, else local processes."""

    name: str
    backend: str = "auto"
    engine: str = "unix:///var/run/docker.sock"
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    #: cores lent to actions; default: every core this process may run on (local nodes only)
    cores: tuple[int, ...] = ()
    #: NUMA nodes as core lists; default: read from the host for local nodes, one group otherwise
    numa: tuple[tuple[int, ...], ...] = ()
    #: memory (MiB) environments may reserve on this node; default: 80% of this host's memory
    memory_mb: int = 0
    #: unix-socket executor + direct cgroup writes; needs the engine on this host. Default: on for unix://
    fast_path: bool | None = None


@dataclass(frozen=True)
class CpuConfig:
    enabled: bool = True
    #: resolved by ``parse_cpu_config``: without a ``[cpu.nodes]`` table, one local node named "local"
    nodes: tuple[CpuNodeConfig, ...] = ()
    #: label value that marks this broker's sandboxes (adopted at start); keep it across restarts
    broker_id: str = "tangram"
    default_image: str = DEFAULT_IMAGE
    default_memory_mb: int = 1024
    pids_limit: int = 1024
    idle_ttl_s: float = 900.0
    max_environments: int = 10_000
    #: where the broker keeps executor sockets and local environments' directories
    run_dir: str = "/run/tangram/sandboxes" if os.geteuid() == 0 else f"/tmp/tangram-{os.geteuid()}/sandboxes"
    limits: ExecLimits = field(default_factory=ExecLimits)
    #: Docker sandboxes get a read-only root filesystem; /workspace and a 64 MiB tmpfs /tmp stay writable
    read_only_root: bool = False
    #: a stopping broker leaves trajectory sandboxes running (idle) for the next start to adopt, so a restart or an
    #: upgrade does not cost trajectories their state; off: a stop removes every sandbox
    keep_sandboxes_on_stop: bool = False
    #: elastic exec actions are malleable: their cores change while they run (shrunk for arriving actions, grown
    #: into idle cores); off: an action keeps the cores it started with (the paper's moldable allocation)
    malleable: bool = True
    #: CPU seconds one more worker of an elastic run costs to start (``pytest -n``: an interpreter importing the
    #: suite; 0.22-0.27 s measured for a small suite, more for suites with heavy imports)
    worker_start_s: float = 0.25
    #: a malleable run gets the workers whose start-up on its first cores stays within this share of its expected
    #: duration there (docs/SCHEDULING.md); 0: as many workers as the cores it starts on, since real suites' workers
    #: cost up to ~7 CPU seconds each (every worker collects the whole suite) and extra ones gained <1% simulated
    worker_overhead: float = 0.0


NODE_KEYS = {"backend", "engine", "tls_ca", "tls_cert", "tls_key", "cores", "numa", "memory_mb", "fast_path"}
TOP_KEYS = {"enabled", "nodes", "broker_id", "default_image", "default_memory_mb", "pids_limit", "idle_ttl_s",
            "max_environments", "run_dir", "limits", "read_only_root", "keep_sandboxes_on_stop", "malleable",
            "worker_start_s", "worker_overhead"}


def parse_cpu_config(raw: Any) -> CpuConfig:
    check_table(raw, "cpu", TOP_KEYS)
    defaults = CpuConfig()
    values: dict[str, Any] = {}
    for key in ("broker_id", "default_image", "run_dir"):
        if key in raw:
            if not isinstance(raw[key], str) or not raw[key]:
                raise ConfigError(f"cpu.{key}", "must be a non-empty string")
            values[key] = raw[key]
    for key in ("default_memory_mb", "pids_limit", "max_environments"):
        if key in raw:
            values[key] = positive_int(raw[key], f"cpu.{key}")
    if "idle_ttl_s" in raw:
        ttl = raw["idle_ttl_s"]
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
            raise ConfigError("cpu.idle_ttl_s", "must be a positive number of seconds")
        values["idle_ttl_s"] = float(ttl)
    for key in ("worker_start_s", "worker_overhead"):
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e6:
                raise ConfigError(f"cpu.{key}", "must be a number >= 0")
            values[key] = float(value)
    for key in ("enabled", "read_only_root", "keep_sandboxes_on_stop", "malleable"):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise ConfigError(f"cpu.{key}", "must be true or false")
            values[key] = raw[key]
    if "limits" in raw:
        values["limits"] = int_limits(ExecLimits, raw["limits"], "cpu.limits")
    nodes = raw.get("nodes", {"local": {}})
    if not isinstance(nodes, dict) or not nodes:
        raise ConfigError("cpu.nodes", "must be a table of at least one node")
    values["nodes"] = tuple(_node(name, spec) for name, spec in nodes.items())
    config = CpuConfig(**{**{k: getattr(defaults, k) for k in TOP_KEYS}, **values})
    local = [node.name for node in config.nodes if node.backend == "local"]
    if config.read_only_root and local:
        raise ConfigError("cpu.read_only_root", f"needs Docker sandboxes, but node {local[0]!r} has backend "
                                                f"\"local\" (its commands share this host's filesystem)")
    longest = max(len(node.name) for node in config.nodes)
    socket_length = len(config.run_dir) + len(config.broker_id) + longest + len("/x/x/env-act_/exec.sock") + 24
    if socket_length > UNIX_PATH_MAX:
        raise ConfigError("cpu.run_dir", f"executor socket paths would be {socket_length} bytes, over the "
                                         f"{UNIX_PATH_MAX} a unix socket allows: shorten run_dir, broker_id or "
                                         f"node names")
    return config


def _node(name: str, raw: Any) -> CpuNodeConfig:
    where = f"cpu.nodes.{name}"
    check_table(raw, where, NODE_KEYS)
    backend = raw.get("backend", "auto")
    if backend not in BACKENDS:
        raise ConfigError(f"{where}.backend", f"must be one of {list(BACKENDS)}")
    engine = raw.get("engine", "unix:///var/run/docker.sock")
    if not isinstance(engine, str) or not engine.startswith(("unix://", "tcp://")):
        raise ConfigError(f"{where}.engine", "must be a unix:// or tcp:// Docker engine address")
    local = engine.startswith("unix://")
    tls = {k: raw.get(k) for k in ("tls_ca", "tls_cert", "tls_key")}
    for key, value in tls.items():
        if value is not None and (not isinstance(value, str) or not os.path.isfile(value)):
            raise ConfigError(f"{where}.{key}", "must be the path of an existing file")
    cores = _cores(raw.get("cores"), f"{where}.cores")
    if not cores:
        if not local:
            raise ConfigError(f"{where}.cores", "is required for a remote engine (e.g. \"0-127\")")
        cores = tuple(sorted(os.sched_getaffinity(0)))
    numa_raw = raw.get("numa", [])
    if not isinstance(numa_raw, list):
        raise ConfigError(f"{where}.numa", 'must be a list of core lists, e.g. ["0-63", "64-127"]')
    numa = tuple(_cores(group, f"{where}.numa[{i}]") for i, group in enumerate(numa_raw))
    if numa and sorted(c for g in numa for c in g) != sorted(cores):
        raise ConfigError(f"{where}.numa", f"must partition the node's cores {list(cores)} exactly")
    memory = raw.get("memory_mb")
    if memory is None:
        if not local:
            raise ConfigError(f"{where}.memory_mb", "is required for a remote engine")
        memory = int(psutil.virtual_memory().total * 0.8) >> 20
    memory = positive_int(memory, f"{where}.memory_mb")
    fast = raw.get("fast_path")
    if fast is not None and not isinstance(fast, bool):
        raise ConfigError(f"{where}.fast_path", "must be true or false")
    if fast and not local:
        raise ConfigError(f"{where}.fast_path", "needs the engine on this host (a unix:// address)")
    return CpuNodeConfig(name=name, backend=backend, engine=engine, cores=cores, numa=numa, memory_mb=memory,
                         fast_path=local if fast is None else fast, **tls)


def _cores(raw: Any, where: str) -> tuple[int, ...]:
    if raw is None:
        return ()
    try:
        if isinstance(raw, str):
            return tuple(parse_cpu_list(raw))
        if isinstance(raw, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in raw):
            return tuple(sorted(set(raw)))
    except ValueError:
        pass
    raise ConfigError(where, 'must be a core list such as "0-3,8" or [0, 1, 2]')
