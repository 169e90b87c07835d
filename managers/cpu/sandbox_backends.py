"""Which sandbox backend a CPU node runs: its Docker engine (local socket or TLS), which must answer and have the
default image when the node starts; or, only where the config says so in so many words (``backend = "local"`` and
``unsandboxed = true``), this host's processes, in no sandbox. Exec never falls back to them: a node without its
engine or image does not start, and the error names the fix. For a node with ``agent = true``, that node's agent
(``managers/remote/broker/ray_agents.py``) opens one of these on its node. The CPU manager takes this as its default
factory; a caller that makes sandboxes otherwise (the simulator, a node agent) passes its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from docker.tls import TLSConfig

from managers.cpu.config import CpuConfig, CpuNodeConfig
from managers.cpu.run_dir import trusted_run_dir
from sandboxes.backend import SandboxBackend, SandboxError, SandboxSpec
from sandboxes.docker import DockerBackend
from sandboxes.local import LocalProcessBackend

log = logging.getLogger("tangram.cpu")

#: opens a node's sandbox backend, started, at the manager's ``start``
SandboxFactory = Callable[[CpuNodeConfig, CpuConfig], Awaitable[SandboxBackend]]


def warm_kinds(config: CpuConfig) -> list[tuple[SandboxSpec, int]]:
    """What a node's warm sandboxes are made as, and how many of each: the default image and memory
    (``warm_sandboxes``), then each ``[[cpu.images.warm_pools]]``; no trajectory yet."""
    kinds = [(config.default_image, config.default_memory_mb, config.warm_sandboxes)]
    kinds += [(pool.image, pool.memory_mb or config.default_memory_mb, pool.size) for pool in config.images.warm_pools]
    return [(config.sandbox_spec("warm", "warm", None, image, memory_mb), size)
            for image, memory_mb, size in kinds if size]


def _fixes(node: CpuNodeConfig, image: str) -> str:
    return (f"start the engine and build the image (tangram image build --name {image}), or run this node's "
            f"commands as unsandboxed local processes ([cpu.nodes.{node.name}] backend = \"local\" and unsandboxed "
            f"= true; scripts/serve.sh does this where Docker is missing), or turn the CPU manager off ([cpu] "
            f"enabled = false)")


def engine_tls(node: CpuNodeConfig) -> TLSConfig | None:
    """The TLS settings of the node's engine (None: a plain one, a local socket)."""
    if not (node.tls_ca or node.tls_cert):
        return None
    cert = (node.tls_cert, node.tls_key) if node.tls_cert and node.tls_key else None
    return TLSConfig(client_cert=cert, ca_cert=node.tls_ca, verify=bool(node.tls_ca))


async def open_sandbox_backend(node: CpuNodeConfig, config: CpuConfig) -> SandboxBackend:
    if node.agent:
        from managers.remote.broker.ray_agents import (
            open_agent_backend,  # Ray is imported only for a node behind an agent
        )

        return await open_agent_backend(node, config)
    run_dir = Path(config.run_dir) / config.broker_id / node.name
    if node.backend == "local":
        log.warning("node %s: exec runs as UNSANDBOXED local processes (backend = \"local\", unsandboxed = true): "
                    "commands run as this broker's user, with its environment and files", node.name)
        local = LocalProcessBackend(run_dir)
        await local.start()
        return local
    if node.fast_path:
        await asyncio.to_thread(trusted_run_dir, run_dir)
    backend = DockerBackend(node.engine, run_dir=run_dir, cores=node.cores, fast_path=bool(node.fast_path),
                            tls=engine_tls(node),
                            warm=warm_kinds(config), creates_per_s=config.creates_per_s, runtime=node.runtime,
                            pull=config.images.policy(),
                            egress=config.egress.rules(config.nodes), python_from=config.default_image)
    try:
        await backend.start()
    except SandboxError as error:
        fixes = "" if error.code == "runtime_unknown" else f"; {_fixes(node, config.default_image)}"
        raise SandboxError(error.code, f"node {node.name}: {error.message}{fixes}") from None
    if not await asyncio.to_thread(backend.has_image, config.default_image):
        await backend.close()
        raise SandboxError("image_not_found", f"node {node.name}: Docker engine {node.engine} has no image "
                                              f"{config.default_image!r} (cpu.default_image); "
                                              f"{_fixes(node, config.default_image)}")
    log.info("node %s: Docker engine %s", node.name, node.engine)
    backend.prefetch(config.images.pre_pull)
    return backend
