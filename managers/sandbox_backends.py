"""Which sandbox backend a CPU node runs: its Docker engine (local socket or TLS), or local processes when the
engine is missing or lacks the image and the node's backend is "auto"; or, for a node with ``agent = true``,
that node's agent (``managers/ray_agents.py``), which opens one of these on its node. The CPU manager takes this as
its default factory; a caller that makes sandboxes otherwise (the simulator, a node agent) passes its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from docker.tls import TLSConfig

from managers.cpu_config import CpuConfig, CpuNodeConfig
from sandboxes.backend import SandboxBackend, SandboxError, SandboxSpec
from sandboxes.docker import DockerBackend
from sandboxes.local import LocalProcessBackend

log = logging.getLogger("tangram.cpu")

#: opens a node's sandbox backend, started, at the manager's ``start``
SandboxFactory = Callable[[CpuNodeConfig, CpuConfig], Awaitable[SandboxBackend]]


def warm_template(config: CpuConfig) -> SandboxSpec:
    """What a node's warm sandboxes are made as: the default image and memory, no trajectory yet."""
    return config.sandbox_spec("warm", "warm", None, config.default_image, config.default_memory_mb)


async def open_sandbox_backend(node: CpuNodeConfig, config: CpuConfig) -> SandboxBackend:
    if node.agent:
        from managers.ray_agents import open_agent_backend  # Ray is imported only for a node behind an agent

        return await open_agent_backend(node, config)
    run_dir = Path(config.run_dir) / config.broker_id / node.name
    if node.backend in ("docker", "auto"):
        tls = None
        if node.tls_ca or node.tls_cert:
            cert = (node.tls_cert, node.tls_key) if node.tls_cert and node.tls_key else None
            tls = TLSConfig(client_cert=cert, ca_cert=node.tls_ca, verify=bool(node.tls_ca))
        docker_backend = DockerBackend(node.engine, run_dir=run_dir, cores=node.cores,
                                       fast_path=bool(node.fast_path), tls=tls, warm=warm_template(config),
                                       warm_size=config.warm_sandboxes, creates_per_s=config.creates_per_s)
        try:
            await docker_backend.start()
            if node.backend == "docker":
                return docker_backend
            if await asyncio.to_thread(docker_backend.has_image, config.default_image):
                log.info("node %s: Docker engine %s", node.name, node.engine)
                return docker_backend
            reason = f"it has no image {config.default_image!r} (build it: tangram image build)"
            await docker_backend.close()
        except SandboxError as error:
            if node.backend == "docker":
                raise
            reason = error.message
        log.warning("node %s: local processes instead of Docker (%s); isolation is weak", node.name, reason)
    local = LocalProcessBackend(run_dir)
    await local.start()
    return local
