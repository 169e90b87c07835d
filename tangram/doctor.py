"""``tangram doctor`` and ``tangram config check``: what an operator checks before ``tangram serve``, one line per
check with the fix for each failure, instead of learning it from a broker that will not start. The CPU nodes'
engine checks are ``tangram/doctor_engines.py``'s."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from tangram.config import Config, load_config
from tangram.core.errors import ConfigError

#: how long the store may take to open, write and roll back; Ray's GCS to accept a connection
STORE_TIMEOUT_S = 10.0
RAY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: ``fix`` says what to do about a FAIL (empty otherwise)."""

    check: str
    status: Literal["PASS", "FAIL", "SKIP"]
    detail: str
    fix: str = ""

    @classmethod
    def ok(cls, check: str, detail: str) -> CheckResult:
        return cls(check, "PASS", detail)

    @classmethod
    def fail(cls, check: str, detail: str, fix: str) -> CheckResult:
        return cls(check, "FAIL", detail, fix)

    @classmethod
    def skip(cls, check: str, detail: str) -> CheckResult:
        return cls(check, "SKIP", detail)

    def line(self) -> str:
        fix = f" | fix: {self.fix}" if self.fix else ""
        return f"{self.status} {self.check}: {self.detail}{fix}"

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def hidden_url(url: str) -> str:
    """The store URL with its password masked, for output that ends up in terminals and CI logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not a database URL)"


def config_summary(config: Config) -> list[str]:
    """What ``tangram config check`` prints for a file that parses: the nodes, the managers and the store."""
    cpu = config.cpu
    nodes = ", ".join(f"{node.name} ({node.backend}" + (f" {node.engine}" if node.backend == "docker" else "") + ")"
                      for node in cpu.nodes) or "none"
    gpu = {True: "on", False: "off", None: "auto (on where NVML finds GPUs)"}[config.gpu.enabled]
    return [f"cpu nodes: {nodes}" + (" and nodes joining from Ray" if cpu.join is not None else ""),
            f"gpu nodes: {', '.join(node.name for node in config.gpu.nodes) or 'none configured'}",
            (f"managers: basic ({', '.join(b.name for b in config.basic) or 'no resources'}), "
             f"cpu {'on' if cpu.enabled else 'off'}, gpu {gpu}"),
            f"store: {hidden_url(config.store.url)}"]


def run_checks(path: str | None) -> list[CheckResult]:
    """Every check of the deployment ``path`` describes (``--config``, else ``$TANGRAM_CONFIG``, else defaults);
    nothing past the config when it does not parse."""
    try:
        config = load_config(path)
    except ConfigError as error:
        return [CheckResult.fail("config", f"{error.key}: {error.reason}",
                                 f"correct {error.key} (`tangram config check` checks the file alone)")]
    results = [CheckResult.ok("config", f"{path or os.environ.get('TANGRAM_CONFIG') or 'built-in defaults'} parses"),
               store_check(config.store.url)]
    docker_nodes = [node for node in config.cpu.nodes if node.backend == "docker"] if config.cpu.enabled else []
    if docker_nodes:
        from tangram.doctor_engines import check_node  # the Docker SDK only where a node uses it

        for node in docker_nodes:
            results += check_node(node, config.cpu)
    else:
        results.append(CheckResult.skip("docker", "no CPU node with backend \"docker\""))
    return [*results, ray_check(config), gpu_check(config)]


def store_check(url: str) -> CheckResult:
    """The store opens (its tables created where missing, as ``serve`` does) and takes a write, rolled back."""
    name, shown = "store", hidden_url(url)
    try:
        asyncio.run(asyncio.wait_for(_write_and_roll_back(url), STORE_TIMEOUT_S))
    except TimeoutError:
        return CheckResult.fail(name, f"{shown} did not answer within {STORE_TIMEOUT_S:.0f} s",
                                "start the database, or correct store.url ($TANGRAM_STORE_URL)")
    except Exception as error:  # noqa: BLE001 - drivers raise their own families for refusals and bad URLs
        return CheckResult.fail(name, f"{shown}: {error!r}",
                                "correct store.url ($TANGRAM_STORE_URL): the database must exist, answer and let "
                                "this user create tables and write")
    return CheckResult.ok(name, f"{shown} reachable and writable")


async def _write_and_roll_back(url: str) -> None:
    from tangram.store.engine import open_engine
    from tangram.store.tables import TransitionRow

    engine = await open_engine(url)
    try:
        async with engine.connect() as conn:
            transaction = await conn.begin()
            await conn.execute(insert(TransitionRow).values(action_id="tangram-doctor", state="doctor", at=0.0))
            await transaction.rollback()
    finally:
        await engine.dispose()


def ray_check(config: Config) -> CheckResult:
    """Ray's cluster accepts a connection, when a node is behind an agent or nodes join; Ray is imported only
    then."""
    name, ray = "ray", config.cpu.ray
    uses = (any(node.agent for node in config.cpu.nodes) or any(node.agent for node in config.gpu.nodes)
            or config.cpu.join is not None or config.gpu.join is not None)
    if not uses:
        return CheckResult.skip(name, "no node behind an agent and none joining: the broker does not use Ray")
    try:
        from ray._private.services import canonicalize_bootstrap_address

        from managers.remote.broker.ray_cluster import token_problem

        problem = token_problem(os.environ, Path.home()) if ray.auth == "token" else None
        if problem is not None:
            return CheckResult.fail(name, f"no token for the cluster: {problem}",
                                    "set RAY_AUTH_MODE=token and the cluster's token, or [ray] auth = \"none\" on a "
                                    "network you trust")
        address = canonicalize_bootstrap_address(ray.address)
        if address is None:
            raise ConnectionError(f"{ray.address!r} names no running cluster")
        host, _, port = address.rpartition(":")
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_TIMEOUT_S).close()
    except Exception as error:  # noqa: BLE001 - a missing package, no cluster, a refused or timed-out connection
        return CheckResult.fail(name, f"cluster {ray.address!r} not reachable: {error}",
                                "start the cluster (ray start --head) or correct [ray] address")
    return CheckResult.ok(name, f"cluster at {address} accepts connections")


def gpu_check(config: Config) -> CheckResult:
    """NVML answers and counts this host's GPUs, when the GPU manager runs with GPUs here."""
    from managers.gpu.config import wanted

    name, gpu = "gpu", config.gpu
    if not wanted(gpu):
        return CheckResult.skip(name, "the GPU manager is off ([gpu] enabled = false, or unset and NVML finds no "
                                      "GPU here)")
    if gpu.nodes and all(node.agent for node in gpu.nodes):
        return CheckResult.skip(name, "every GPU node is behind its agent, on its own host")
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception as error:  # noqa: BLE001 - no package, no driver, a driver/library mismatch
        return CheckResult.fail(name, f"NVML did not answer: {error!r}",
                                "install the NVIDIA driver and nvidia-ml-py, or set [gpu] enabled = false")
    if count == 0:
        return CheckResult.fail(name, "NVML finds no GPU", "set [gpu] enabled = false on a host without GPUs")
    return CheckResult.ok(name, f"NVML finds {count} GPU(s)")
