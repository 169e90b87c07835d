"""Configuration of the CPU manager: its nodes (Docker engines or this host's processes) and sandbox defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import psutil
from pydantic import AfterValidator, BeforeValidator, Field, Strict

from managers.cpu.cores import host_numa_nodes
from managers.cpu.exec_spec import ExecLimits, PytestRunner, SandboxUser
from managers.cpu.image_config import ImagesConfig
from managers.remote.broker.ray_config import RayConfig, check_no_ray_keys
from sandboxes.backend import DEFAULT_SANDBOX_USER, SandboxSpec
from sandboxes.cgroup import parse_cpu_list
from sandboxes.egress_policy import DEFAULT_DENY_PORTS, AddressRules, AllowList, BadRule
from sandboxes.image import DEFAULT_IMAGE
from tangram.core.config_tables import TABLE, Count, Flag, NonNegative, PositiveSeconds, Text, named_tables, table
from tangram.core.errors import ConfigError, Unprocessable

UNIX_PATH_MAX = 107
LOCAL_ENGINE = "unix:///var/run/docker.sock"


def _core_list(raw: Any) -> Any:
    """``"0-3,8"`` as its cores; a list is checked by the type (non-negative integers), then sorted, each once."""
    if isinstance(raw, str):
        try:
            return parse_cpu_list(raw)
        except ValueError:
            raise ValueError('must be a core list such as "0-3,8" or [0, 1, 2]') from None
    return raw


def _engine(address: str) -> str:
    if not address.startswith(("unix://", "tcp://")):
        raise ValueError("must be a unix:// or tcp:// Docker engine address")
    return address


def _no_auto(value: Any) -> Any:
    if value == "auto":
        raise ValueError('"auto" (Docker, else local processes) is gone: exec never falls back to unsandboxed '
                         'processes. Use "docker" (the default), or "local" with unsandboxed = true')
    return value


def _existing_file(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError("must be the path of an existing file")
    return path


CoreList = Annotated[tuple[Annotated[int, Strict(), Field(ge=0)], ...], BeforeValidator(_core_list),
                     AfterValidator(lambda cores: tuple(sorted(set(cores))))]
ExistingFile = Annotated[str, Strict(), AfterValidator(_existing_file)]
#: "docker": the node's Docker engine, which must answer and have the default image at start; "local": this host's
#: processes, unsandboxed, only with ``unsandboxed = true`` beside it
Backend = Annotated[Literal["docker", "local"], BeforeValidator(_no_auto)]
NonNegativeCost = Annotated[float, Strict(), Field(ge=0, le=1e6)]


@dataclass(frozen=True)
class CpuNodeConfig:
    """One node: a Docker engine, or (``backend = "local"``, ``unsandboxed = true``) this host's processes."""

    __pydantic_config__ = TABLE

    name: str
    backend: Backend = "docker"
    #: says that ``backend = "local"`` is meant: commands run as the broker's user (root for the fast path), with
    #: its environment and filesystem, in no sandbox; required with "local", refused with "docker"
    unsandboxed: Flag = False
    engine: Annotated[str, Strict(), AfterValidator(_engine)] = LOCAL_ENGINE
    tls_ca: ExistingFile | None = None
    tls_cert: ExistingFile | None = None
    tls_key: ExistingFile | None = None
    #: cores lent to actions; default: every core this process may run on (local nodes and nodes behind an agent,
    #: which reads its own host's)
    cores: CoreList = ()
    #: NUMA nodes as core lists; default: read from the host for local nodes, one group otherwise
    numa: tuple[CoreList, ...] = ()
    #: memory (MiB) environments may reserve on this node; default (0): 80% of its host's memory, read at start
    memory_mb: NonNegative = 0
    #: processes (threads) this node's sandboxes may hold in all: each reserves its ``pids_limit`` for its life,
    #: warm ones too, so that full sandboxes cannot empty the host's process table; default (0): 80% of its host's
    #: kernel limit (the lower of kernel.pid_max and kernel.threads-max), read at start on a local engine or by
    #: the node's agent, and no budget for a remote engine
    pids: NonNegative = 0
    #: unix-socket executor + direct cgroup writes; needs the engine on this host. Default: on for unix://
    fast_path: Flag | None = None
    #: run this node's sandboxes through its node agent: a Ray actor on the Ray node that carries the custom
    #: resource ``tangram_node_<name>``, opening the engine above there (so a unix:// engine is that node's own)
    agent: Flag = False
    #: the engine's OCI runtime for this node's sandboxes, by the name the engine knows it under (e.g. "runsc":
    #: gVisor, a kernel of its own between the sandbox and the host's, at a cost: docs/SECURITY.md); default: the
    #: engine's own (runc)
    runtime: Text | None = None

    @property
    def local(self) -> bool:
        return self.engine.startswith("unix://")


def _allow_list(entries: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return AllowList.parse(entries).entries()
    except BadRule as error:
        raise ValueError(f"entry {error.index} {error.reason}") from None


Port = Annotated[int, Strict(), Field(ge=1, le=65535)]


@dataclass(frozen=True)
class EgressConfig:
    """``[cpu.egress]``: whether an environment may ask for ``network = {mode = "proxy", allow = [...]}``, an HTTP(S)
    proxy on its sandbox's loopback that reaches the hosts it lists (``sandboxes/egress_proxy.py``), and what such a
    proxy may reach at most. Off by default: sandboxes have no network at all unless the operator turns this on."""

    __pydantic_config__ = TABLE

    enabled: Flag = False
    #: the ceiling: entries as in ``network.allow``, and every entry of an environment's list must fall within one
    #: (``*.example.com`` covers ``a.example.com:443``); empty: no ceiling, the address rules below alone
    allow: Annotated[tuple[Text, ...], AfterValidator(_allow_list)] = ()
    #: destinations that resolve to the node's own addresses (loopback, its interfaces'): never on a port the
    #: broker (or node agent) running the proxy listens on, nor on ``deny_ports``
    allow_loopback: Flag = False
    #: private, CGNAT and other non-global addresses that are not the node's own
    allow_private: Flag = False
    #: ports never connected to, on any address (default: the Docker engine's TCP ports and Ray's); the ports of the
    #: configured TCP Docker engines are added
    deny_ports: tuple[Port, ...] = DEFAULT_DENY_PORTS

    def admit(self, allow: tuple[str, ...] | None, where: str) -> None:
        """422 naming ``where`` for a network this broker does not offer: egress off, or an entry past the
        ceiling."""
        if allow is None:
            return
        if not self.enabled:
            raise Unprocessable(f"{where}.mode", 'this broker offers no egress ([cpu.egress] enabled = false): '
                                                 'its sandboxes have no network')
        outside = AllowList.parse(allow).outside(AllowList.parse(self.allow)) if self.allow else None
        if outside is not None:
            raise Unprocessable(f"{where}.allow[{outside}]", f"{allow[outside]} is not within the hosts this "
                                                             f"broker lets sandboxes reach ([cpu.egress] allow)")

    def rules(self, nodes: tuple[CpuNodeConfig, ...]) -> AddressRules | None:
        """The address rules a node's proxies enforce; None while egress is off."""
        if not self.enabled:
            return None
        engines = {int(node.engine.rsplit(":", 1)[1]) for node in nodes
                   if node.engine.startswith("tcp://") and node.engine.rsplit(":", 1)[1].isdigit()}
        return AddressRules(self.allow_loopback, self.allow_private, frozenset(self.deny_ports) | engines)


@dataclass(frozen=True)
class JoinConfig:
    """How a node that joins from the Ray cluster opens its sandboxes: a Ray node carrying the custom resource
    ``tangram_node_<name>`` that no ``[cpu.nodes]`` table names becomes CPU node ``<name>`` behind its agent, its
    cores, memory and NUMA layout as the agent reads them on its host."""

    __pydantic_config__ = TABLE

    backend: Backend = "docker"
    unsandboxed: Flag = False
    #: the joining host's engine, as that host sees it
    engine: Annotated[str, Strict(), AfterValidator(_engine)] = LOCAL_ENGINE
    fast_path: Flag | None = None

    def node(self, name: str) -> CpuNodeConfig:
        return CpuNodeConfig(name=name, backend=self.backend, unsandboxed=self.unsandboxed, engine=self.engine,
                             fast_path=self.fast_path, agent=True)


@dataclass(frozen=True)
class CpuConfig:
    __pydantic_config__ = TABLE

    enabled: Flag = True
    #: without a ``[cpu.nodes]`` table, one node named "local": this host (none when nodes join: ``join``)
    nodes: tuple[CpuNodeConfig, ...] = (CpuNodeConfig(name="local"),)
    #: label value that marks this broker's sandboxes (adopted at start); keep it across restarts
    broker_id: Text = "tangram"
    default_image: Text = DEFAULT_IMAGE
    default_memory_mb: Count = 1024
    pids_limit: Count = 1024
    #: who the executor and the commands of Docker sandboxes run as: "UID:GID" (the image need not name them) or
    #: "root" (the container's root, with no capabilities: the host's root unless the engine remaps users)
    sandbox_user: Annotated[SandboxUser, Strict()] = DEFAULT_SANDBOX_USER
    #: the disk a Docker sandbox's writes may take, in MiB (0: no cap), where the engine's storage can cap one: the
    #: engine's ``--storage-opt size`` on the btrfs driver (with simple quotas; full quota groups also count the
    #: image, and stop enforcing once a deleted container leaves them inconsistent) or overlay2 on XFS with project
    #: quotas; elsewhere sandboxes run uncapped and the node says so (``disk_capped``)
    disk_mb: NonNegative = 10_240
    idle_ttl_s: PositiveSeconds = 900.0
    max_environments: Count = 10_000
    #: where the broker keeps executor sockets and local environments' directories
    run_dir: Text = "/run/tangram/sandboxes" if os.geteuid() == 0 else f"/tmp/tangram-{os.geteuid()}/sandboxes"
    limits: ExecLimits = field(default_factory=ExecLimits)
    #: Docker sandboxes get a read-only root filesystem; /workspace and a 64 MiB tmpfs /tmp stay writable
    read_only_root: Flag = False
    #: a stopping broker leaves trajectory sandboxes running (idle) for the next start to adopt, so a restart or an
    #: upgrade does not cost trajectories their state; off: a stop removes every sandbox
    keep_sandboxes_on_stop: Flag = False
    #: elastic exec actions are malleable: their cores change while they run (shrunk for arriving actions, grown
    #: into idle cores); off: an action keeps the cores it started with (the paper's moldable allocation)
    malleable: Flag = True
    #: started, frozen sandboxes of the default image and memory each Docker node keeps for new trajectories
    #: (fast path only; not counted in the node's memory reservations); other kinds: ``[[cpu.images.warm_pools]]``
    warm_sandboxes: NonNegative = 0
    #: sandbox creations a node starts per second (warm refills and cold creates alike); more wait their turn
    creates_per_s: Annotated[float, Strict(), Field(gt=0, le=1e4)] = 10.0
    #: the ``[ray]`` section, for the nodes with ``agent = true`` and joining nodes (``parse_config`` sets it)
    ray: RayConfig = field(default_factory=RayConfig)
    #: nodes join (and leave) at runtime from that Ray cluster; absent: only the configured nodes serve
    join: JoinConfig | None = None
    #: CPU seconds one more worker of an elastic run costs to start (``pytest -n``: an interpreter importing the
    #: suite; 0.22-0.27 s measured for a small suite, more for suites with heavy imports)
    worker_start_s: NonNegativeCost = 0.25
    #: a malleable run gets the workers whose start-up on its first cores stays within this share of its expected
    #: duration there (docs/SCHEDULING.md); 0: as many workers as the cores it starts on, since real suites' workers
    #: cost up to ~7 CPU seconds each (every worker collects the whole suite) and extra ones gained <1% simulated
    worker_overhead: NonNegativeCost = 0.0
    #: what an elastic ``pytest`` (``pytest_parallel``) runs on: ``tangram``, the runner shipped with the executor
    #: (one collection, forked workers that follow the cores), or ``xdist`` (``pytest -n N``, which the image needs)
    pytest_runner: PytestRunner = "tangram"
    #: ``[cpu.images]``: pulling images on demand, registries, pre-pulls, image locality, warm pools per image
    images: ImagesConfig = field(default_factory=ImagesConfig)
    egress: EgressConfig = field(default_factory=EgressConfig)

    def sandbox_spec(self, env_id: str, task: str, trajectory: str | None, image: str, memory_mb: int,
                     **more: Any) -> SandboxSpec:
        """A sandbox of this broker's: the environment's identity, the config's limits and broker label, and its
        user (``sandbox_user`` unless ``more`` names another)."""
        return SandboxSpec(env_id=env_id, task=task, trajectory=trajectory, image=image, memory_mb=memory_mb,
                           pids_limit=self.pids_limit, broker_id=self.broker_id,
                           read_only_root=self.read_only_root, disk_mb=self.disk_mb,
                           **{"user": self.sandbox_user, **more})


def parse_cpu_config(raw: Any) -> CpuConfig:
    """The ``[cpu]`` section. Nothing here reads the hardware: a local node's defaults are read at manager start
    (``on_this_host``)."""
    if isinstance(raw, dict):
        check_no_ray_keys(raw, "cpu")
    config = table(CpuConfig, {k: v for k, v in raw.items() if k != "nodes"} if isinstance(raw, dict) else raw, "cpu")
    nodes_raw = raw.get("nodes", {} if config.join else {"local": {}}) if isinstance(raw, dict) else None
    nodes = named_tables(CpuNodeConfig, nodes_raw, "cpu.nodes")
    if not nodes and config.join is None:
        raise ConfigError("cpu.nodes", "must be a table of at least one node (or let nodes join: [cpu.join])")
    for node in nodes:
        _check_node(node, f"cpu.nodes.{node.name}")
    config = replace(config, nodes=nodes)
    local = [node.name for node in nodes if node.backend == "local"]
    if config.read_only_root and local:
        raise ConfigError("cpu.read_only_root", f"needs Docker sandboxes, but node {local[0]!r} has backend "
                                                f"\"local\" (its commands share this host's filesystem)")
    for where, backend in [*((f"cpu.nodes.{node.name}", node) for node in nodes),
                           *((("cpu.join", config.join),) if config.join is not None else ())]:
        _check_unsandboxed(backend, where)
    longest = max((len(node.name) for node in nodes), default=0)
    socket_length = len(config.run_dir) + len(config.broker_id) + longest + len("/x/x/env-act_/exec.sock") + 24
    if socket_length > UNIX_PATH_MAX:
        raise ConfigError("cpu.run_dir", f"executor socket paths would be {socket_length} bytes, over the "
                                         f"{UNIX_PATH_MAX} a unix socket allows: shorten run_dir, broker_id or "
                                         f"node names")
    return config


def _check_unsandboxed(node: CpuNodeConfig | JoinConfig, where: str) -> None:
    """Local processes only when the config says they are unsandboxed, in so many words."""
    if node.backend == "local" and not node.unsandboxed:
        raise ConfigError(f"{where}.unsandboxed", 'must be true for backend = "local": its commands run as this '
                                                  'broker\'s user with its environment, in no sandbox. Say so, or '
                                                  'use backend = "docker" (tangram image build makes the image)')
    if node.unsandboxed and node.backend != "local":
        raise ConfigError(f"{where}.unsandboxed", 'is only for backend = "local"')


def _check_node(node: CpuNodeConfig, where: str) -> None:
    """What one key cannot say alone: a remote engine names its node's cores and memory (an agent reads them on
    its node), NUMA groups partition the cores."""
    if not node.local and not node.agent:
        for key in ("cores", "memory_mb"):
            if not getattr(node, key):
                raise ConfigError(f"{where}.{key}", "is required for a remote engine (e.g. cores = \"0-127\")")
        if node.fast_path:
            raise ConfigError(f"{where}.fast_path", "needs the engine on this host (a unix:// address)")
    if node.numa and node.cores and sorted(c for g in node.numa for c in g) != list(node.cores):
        raise ConfigError(f"{where}.numa", f"must partition the node's cores {list(node.cores)} exactly")
    if node.runtime is not None and node.backend != "docker":
        raise ConfigError(f"{where}.runtime", 'is the Docker engine\'s runtime: only for backend = "docker"')


def host_pids_budget() -> int:
    """80% of this host's kernel limit on processes and threads: the lower of kernel.pid_max and threads-max."""
    limits = []
    for name in ("pid_max", "threads-max"):
        try:
            limits.append(int(Path(f"/proc/sys/kernel/{name}").read_text()))
        except (OSError, ValueError):
            continue
    return int(min(limits) * 0.8) if limits else 0


def on_this_host(node: CpuNodeConfig) -> CpuNodeConfig:
    """``node`` with the defaults read from this host where the config left them out: every core this process may
    run on, 80% of its memory, its NUMA layout, the fast path and the pids budget for a local engine. The manager
    calls it at start for its own nodes, a node agent on its host for its node; a node behind an agent is left to
    its agent."""
    if node.agent:
        return node
    cores = node.cores or tuple(sorted(os.sched_getaffinity(0)))
    numa = node.numa or (tuple(tuple(group) for group in host_numa_nodes(cores)) if node.local else (cores,))
    node = replace(node, cores=cores, memory_mb=node.memory_mb or int(psutil.virtual_memory().total * 0.8) >> 20,
                   numa=numa, fast_path=node.local if node.fast_path is None else node.fast_path,
                   pids=node.pids or (host_pids_budget() if node.local else 0))
    _check_node(node, f"cpu.nodes.{node.name}")
    return node
