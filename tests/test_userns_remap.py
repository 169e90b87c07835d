"""Sandboxes on an engine run with user-namespace remapping (``--userns-remap``): a sandbox's ids, root included,
are unprivileged ids on the host, and the broker still gives it what it must write (the socket directory its
executor listens in, a read-only root's work dir) and still seals that directory from it. The engine is the test
command's third one (``scripts/start-docker.sh``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import docker
import pytest

from sandboxes.backend import LABEL_BROKER, LABEL_TRAJECTORY, SandboxError
from sandboxes.id_mapping import IdMapping
from tests.docker_nodes import cpu_config, labelled_containers, userns_engine
from tests.harness import Live, live_broker

#: the probe every sandbox runs: who it is, how its namespace maps ids, whether it can write its socket directory
PROBE = "id -u; cat /proc/self/uid_map; touch /run/tangram/x 2>/dev/null; echo write=$?; echo kept > note"


def remapped(fast_path: bool = True, **cpu: Any) -> dict[str, Any]:
    return cpu_config({"n1": {"backend": "docker", "engine": userns_engine(), "cores": "0-1", "memory_mb": 2048,
                              "fast_path": fast_path}}, default_memory_mb=128, **cpu)


async def exec_in(live: Live, command: str, trajectory: str = "t", **spec: Any) -> dict[str, Any]:
    status, record = await live.call("POST", "/v1/actions?wait=true", json={
        "task": "userns", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1}, "timeout_s": 60,
        "spec": {"command": command, **spec}})
    assert status == 200 and record["state"] == "succeeded" and record["result"]["exit_code"] == 0, record
    return dict(record["result"])


def host_uid(engine: str, broker_id: str, trajectory: str) -> int:
    """The host uid of the sandbox's first process (its init), read from the host's /proc."""
    client = docker.DockerClient(base_url=engine)
    try:
        [container] = client.containers.list(filters={"label": [f"{LABEL_BROKER}={broker_id}",
                                                                f"{LABEL_TRAJECTORY}={trajectory}"]})
        pid = container.attrs["State"]["Pid"]
    finally:
        client.close()
    with open(f"/proc/{pid}/status") as status:
        uids = next(line for line in status if line.startswith("Uid:"))
    return int(uids.split()[1])


@pytest.fixture
def kept() -> Iterator[dict[str, Any]]:
    """A config whose stop keeps the sandboxes for the next start; they are removed after the test."""
    raw = remapped(keep_sandboxes_on_stop=True)
    yield raw
    for container in labelled_containers(userns_engine(), raw["cpu"]["broker_id"]):
        container.remove(force=True)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "engine"])
@pytest.mark.parametrize("user", ["1000:1000", "root"])
async def test_a_sandbox_and_its_root_are_unprivileged_on_the_host(fast_path, user, tmp_path):
    """The sandbox's user (root too) is the remap range's id on the host, not the host's; on the fast path the
    executor could make its socket in the directory the broker shifted to it, which is sealed from it after."""
    raw = remapped(fast_path)
    uid = 0 if user == "root" else 1000
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        result = await exec_in(live, PROBE, sandbox_user=user)
        _, resources = await live.call("GET", "/v1/resources")
        on_host = host_uid(userns_engine(), raw["cpu"]["broker_id"], "t")
    seen, uid_map, write = result["stdout"].split("\n")[:3]
    base = int(uid_map.split()[1])
    assert int(seen) == uid and base > 0 and on_host == base + uid, (result, on_host)
    assert write == "write=1", result  # sealed on the fast path; the engine path shares no directory
    assert [row["userns_remap"] for row in resources["resources"] if row["resource"] == "cpu"] == [True]


async def test_a_read_only_root_work_dir_is_the_sandbox_users_under_remapping(tmp_path):
    """The broker hands a read-only root's work dir (a volume the engine makes) to the sandbox user's host id."""
    async with live_broker(remapped(read_only_root=True), str(tmp_path / "t.db")) as live:
        result = await exec_in(live, "cat given; echo new > made; stat -c %u . made", files={"given": "from spec\n"})
    assert result["stdout"].split("\n")[:3] == ["from spec", "1000", "1000"], result


async def test_a_remapped_sandbox_is_adopted_after_a_restart(kept, tmp_path):
    """Across a restart with the sandboxes kept, the trajectory's sandbox is adopted (its socket directory read
    from the engine's mounts) and still holds what the command wrote."""
    db = str(tmp_path / "t.db")
    async with live_broker(kept, db) as live:
        first = await exec_in(live, PROBE)
    async with live_broker(kept, db) as live:
        again = await exec_in(live, "cat note")
    assert again["stdout"] == "kept\n" and again["environment"] == first["environment"], again


def test_the_mapping_is_read_from_the_engine():
    """An engine that does not remap maps ids to themselves; one that does names its root's host ids in its data
    root; one that remaps under a data root without them is refused, naming the engine."""
    plain = IdMapping.of_engine("e", {"SecurityOptions": ["name=seccomp,profile=default"],
                                      "DockerRootDir": "/var/lib/docker"})
    shifted = IdMapping.of_engine("e", {"SecurityOptions": ["name=userns"],
                                        "DockerRootDir": "/var/lib/docker/231072.231073"})
    assert not plain.remaps and plain.on_host((1000, 1000)) == (1000, 1000)
    assert shifted.remaps and shifted.on_host((1000, 1001)) == (232072, 232074)
    with pytest.raises(SandboxError, match="engine e remaps"):
        IdMapping.of_engine("e", {"SecurityOptions": ["name=userns"], "DockerRootDir": "/srv/docker"})
