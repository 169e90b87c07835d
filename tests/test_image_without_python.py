"""Images without python3 (issue 38): the executor borrows the default image's python3, copied once per engine into
a volume and mounted read-only; the image's own commands never see it. On real engines through a live broker, on the
fast path (the executor's socket) and on the engine path (``docker exec`` of the executor's one-shot mode), and with
files, a fork and a broker restart on it."""

from __future__ import annotations

import base64
import contextlib
import platform
import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import docker
import pytest

from sandboxes import executor_python
from sandboxes.backend import SandboxError, SandboxSpec
from sandboxes.docker import DockerBackend
from sandboxes.executor_python import BORROWED, LABEL, MOUNT_POINT, PROBE, VOLUME_PREFIX
from sandboxes.image import DEFAULT_IMAGE
from tests.docker_nodes import derived_images, docker_engines, new_broker_id
from tests.harness import Live, live_broker
from tests.test_cpu_docker import exec_action, one_node, run

RUN_DIR = "/run/tangram/test-sandboxes"
#: what the image's commands see of python3 and of the borrowed copy
LOOK = f"command -v python3 || echo no-python3; ls {MOUNT_POINT}/current/python/bin; touch {MOUNT_POINT}/x || echo ro"


def without_python3(client: docker.DockerClient) -> Any:
    """A container of the default image with every python3 taken off its PATH."""
    container = client.containers.run(DEFAULT_IMAGE, ["sh", "-c", "rm -f /usr/bin/python3* /usr/local/bin/python3*"],
                                      user="0:0", network_mode="none", detach=True)
    assert container.wait(timeout=60)["StatusCode"] == 0
    return container


@pytest.fixture(scope="module")
def images() -> Iterator[Mapping[str, str]]:
    with derived_images("tangram-test/no-python3", without_python3) as made:
        yield made


def borrowed_volumes(engine: str) -> list[str]:
    client = docker.DockerClient(base_url=engine)
    try:
        return [volume.name for volume in client.volumes.list(filters={"label": LABEL})]
    finally:
        client.close()


def default_image_id(engine: str) -> str:
    client = docker.DockerClient(base_url=engine)
    try:
        return str(client.images.get(DEFAULT_IMAGE).id).split(":")[-1]
    finally:
        client.close()


async def shell(live: Live, trajectory: str, command: str, image: str) -> list[str]:
    record = await run(live, exec_action(command, trajectory=trajectory, image=image, memory_mb=256))
    assert record["state"] == "succeeded", record
    return str(record["result"]["stdout"]).split()


@pytest.mark.parametrize("path", ["fast", "engine"])
async def test_an_image_without_python3_runs_commands_files_and_forks(path, images, tmp_path):
    engine = docker_engines()[0 if path == "fast" else 1]
    image = images[engine]
    config = one_node(engine, fast_path=path == "fast")
    config["cpu"]["run_dir"] = RUN_DIR
    async with live_broker(config, str(tmp_path / "t.db")) as live:
        assert await shell(live, "a", LOOK, image) == ["no-python3", "python3", "ro"]
        _, listed = await live.call("GET", "/v1/environments?task=t")
        env = next(e["id"] for e in listed["environments"] if e["trajectory"] == "a")
        blob = random.randbytes(50_000)  # the engine path takes 90 KiB a request
        status, body = await live.call("PUT", f"/v1/environments/{env}/files", json={"files": {
            "in/note.txt": "written later", "in/blob.bin": {"base64": base64.b64encode(blob).decode()}}})
        assert status == 200, body
        assert await shell(live, "a", "cat in/note.txt; echo; wc -c < in/blob.bin", image) == \
            ["written", "later", "50000"]
        status, read = await live.call("GET", f"/v1/environments/{env}/files", params={"path": "in/note.txt"})
        assert (status, read) == (200, "written later"), read
        status, body = await live.call("POST", f"/v1/environments/{env}/fork?n=2", json={"trajectories": ["f0", "f1"]})
        assert status == 201, body
        for fork in ("f0", "f1"):
            assert await shell(live, fork, "cat in/note.txt; echo; command -v python3 || echo none", image) == \
                ["written", "later", "none"]
        assert await shell(live, "b", "echo default", DEFAULT_IMAGE) == ["default"]  # its own python3, as before
    # one copy per engine, named by the image it came from, and kept for the next broker
    assert VOLUME_PREFIX + default_image_id(engine)[:12] in borrowed_volumes(engine)


async def test_a_restarted_broker_adopts_a_sandbox_that_borrows_python3(images, tmp_path):
    """The adopted sandbox is found to borrow from its mounts: the engine path's one-shot executor starts from it."""
    engine = docker_engines()[1]
    config = one_node(engine, fast_path=False)
    config["cpu"].update(run_dir=RUN_DIR, keep_sandboxes_on_stop=True)
    db = str(tmp_path / "t.db")
    async with live_broker(config, db) as live:
        assert await shell(live, "a", "echo first > mark", images[engine]) == []
    config["cpu"]["keep_sandboxes_on_stop"] = False
    async with live_broker(config, db) as live:
        assert await shell(live, "a", "cat mark; command -v python3 || echo none", images[engine]) == ["first", "none"]


def test_the_borrowed_python3_needs_no_library_of_the_image(images):
    """Started as the executor is, the copy imports what the executor and its file ops import, and the modules that
    load shared libraries, in a container whose system library directory is empty."""
    engine = docker_engines()[0]
    volume = VOLUME_PREFIX + default_image_id(engine)[:12]
    assert volume in borrowed_volumes(engine), "made by the broker of the test before"
    code = ("import json, os, pwd, resource, selectors, signal, socket, struct, subprocess, tarfile, threading, zlib,"
            " ssl, hashlib, ctypes; print(zlib.ZLIB_VERSION, ssl.OPENSSL_VERSION_INFO[0])")
    client = docker.DockerClient(base_url=engine)
    try:
        output = client.containers.run(images[engine], [*BORROWED, "-c", code], network_mode="none", remove=True,
                                       user="1000:1000", tmpfs={f"/usr/lib/{platform.machine()}-linux-gnu": ""},
                                       volumes={volume: {"bind": MOUNT_POINT, "mode": "ro"}})
    finally:
        client.close()
    assert output.decode().split()[1] == "3", output


async def test_without_an_image_to_borrow_from_the_sandbox_is_refused_by_name(images):
    engine = docker_engines()[1]
    backend = DockerBackend(engine, run_dir=Path(RUN_DIR), cores=(0,), fast_path=False)
    await backend.start()
    spec = SandboxSpec(env_id=f"nopy-{random.randrange(10**9)}", task="t", trajectory=None, image=images[engine],
                       memory_mb=128, pids_limit=64, broker_id=new_broker_id(), ephemeral=True)
    try:
        with pytest.raises(SandboxError) as refused:
            await backend.create(spec)
        assert refused.value.code == "image_without_python3" and images[engine] in refused.value.message
    finally:
        await backend.close()


async def test_a_restarted_broker_removes_the_probes_a_killed_one_left_and_no_live_one(monkeypatch):
    """A broker killed between a probe's create and its removal leaves it: the next start's adoption removes it once
    it is past a probe's life, and a fresh one (another broker's, probing now) stays."""
    engine = docker_engines()[1]
    client = docker.DockerClient(base_url=engine)
    left = client.containers.create(DEFAULT_IMAGE, ["python3"], network_mode="none", labels={LABEL: PROBE})
    backend = DockerBackend(engine, run_dir=Path(RUN_DIR), cores=(0,), fast_path=False)
    await backend.start()
    try:
        await backend.adopt(new_broker_id())
        left.reload()  # still there: younger than a probe's life
        monkeypatch.setattr(executor_python, "PROBE_LEFTOVER_S", 0.0)
        await backend.adopt(new_broker_id())
        with pytest.raises(docker.errors.NotFound):
            left.reload()
    finally:
        await backend.close()
        with contextlib.suppress(docker.errors.NotFound):
            left.remove(force=True)
        client.close()
