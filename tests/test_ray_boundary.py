"""The Ray cluster's boundary (issue 35): a cluster on one machine keeps every listener and peer on 127.0.0.1
(``managers/remote/broker/ray_loopback.py``), and the broker joins with ``[ray] auth = "token"`` only a cluster that
refuses a wrong token (``managers/remote/broker/ray_auth_probe.py``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from managers.remote.broker.ray_cluster import connect, node_resource
from managers.remote.broker.ray_config import RayConfig
from managers.remote.broker.ray_loopback import LOOPBACK_SWITCH
from tangram.core.loopback import is_loopback
from tests.docker_nodes import docker_engines, new_broker_id
from tests.ray_clusters import NODE, two_node_cluster
from tests.test_recovery import free_port

#: a one-node cluster in its own process, started from the environment it is given; it stops when its stdin closes
CLUSTER_PROCESS = (f"import sys\nfrom managers.remote.broker.ray_loopback import one_machine_cluster\n"
                   f"cluster = one_machine_cluster({NODE!r})\nprint(cluster.address, flush=True)\n"
                   f"sys.stdin.read()\ncluster.shutdown()\n")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    with two_node_cluster(node_resource("b1"), node_resource("b2")) as cluster:
        yield cluster


def off_loopback_sockets(processes: Iterable[psutil.Process]) -> list[str]:
    """Every TCP/UDP socket of ``processes`` that listens on or talks to an address outside loopback."""
    found = []
    for process in processes:
        try:
            name, connections = process.name(), process.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for socket in connections:
            ends = [socket.laddr, *([socket.raddr] if socket.raddr else [])]
            if not all(is_loopback(end.ip) for end in ends):
                found.append(f"{name} ({process.pid}) {socket.status} {socket.laddr} -> {socket.raddr}")
    return found


def test_every_socket_of_the_test_cluster_stays_on_loopback(ray_cluster: Cluster) -> None:
    """The driver (this process, joined as the broker joins: the token check passes) and every process the cluster
    started (GCS, raylets, agents, the workers of an actor on each node), read while an actor call has happened."""
    connect(RayConfig(address=ray_cluster.address))

    class Pid:
        def pid(self) -> int:
            return os.getpid()

    remote_pid: Any = ray.remote(num_cpus=0)(Pid)
    actors = [remote_pid.options(resources={node_resource(node): 0.001}).remote() for node in ("b1", "b2")]
    try:
        actor_pids = ray.get([actor.pid.remote() for actor in actors], timeout=60)
        me = psutil.Process()
        processes = [me, *me.children(recursive=True)]
        names = [process.info["name"] for process in psutil.process_iter(["name"]) if process in processes]
        assert set(actor_pids) <= {process.pid for process in processes}  # the walk sees the cluster's processes
        assert names.count("raylet") >= 2 and "gcs_server" in names, names
        assert off_loopback_sockets(processes) == []
    finally:
        for actor in actors:
            ray.kill(actor)


@contextmanager
def cluster_without_auth() -> Iterator[str]:
    """The address of a one-node cluster on loopback whose processes run without Ray's token authentication."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    process = subprocess.Popen([sys.executable, "-c", CLUSTER_PROCESS], env=environ, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdin is not None and process.stdout is not None
    try:
        yield process.stdout.readline().strip()
    finally:
        process.stdin.close()
        process.wait(60)


async def refusal(address: str, environ: dict[str, str], tmp_path: Path) -> str:
    """What a broker with one agent node, joining the cluster at ``address`` from ``environ``, says as it exits
    (it must fail)."""
    config = tmp_path / "b.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path}/b.db"\n'
                      f'[cpu]\nbroker_id = "{new_broker_id()}"\n'
                      f'[cpu.nodes.n1]\nagent = true\nbackend = "docker"\nengine = "{docker_engines()[0]}"\n')
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tangram.cli", "serve", "--config", str(config), "--port", str(free_port()),
        "--ray", address, env=environ, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode != 0, stderr.decode()[-2000:]
    return stderr.decode()


async def test_a_cluster_that_accepts_a_wrong_token_is_not_joined(tmp_path) -> None:
    """The broker holds a token and ``[ray] auth = "token"``, but the cluster was started without authentication:
    it would accept anyone, so the broker refuses it."""
    with cluster_without_auth() as address:
        assert is_loopback(address.rpartition(":")[0]), address
        stderr = await refusal(address, dict(os.environ), tmp_path)
    assert "does not enforce token authentication (it answered a call with a wrong token)" in stderr, stderr[-2000:]


async def test_a_loopback_cluster_is_not_joined_through_the_interface(tmp_path) -> None:
    """Without the loopback switch Ray would rewrite 127.0.0.1 to this host's interface address: the broker says
    so and names the switch before it tries (no cluster is needed to refuse)."""
    environ = {key: value for key, value in os.environ.items() if key != LOOPBACK_SWITCH}
    stderr = await refusal(f"127.0.0.1:{free_port()}", environ, tmp_path)
    assert f"starts with {LOOPBACK_SWITCH}=0" in stderr, stderr[-2000:]
