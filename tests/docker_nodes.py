"""The real Docker engines the sandbox tests run on, and broker configs that use them.

``eval "$(bash scripts/start-docker.sh)"`` (run by scripts/test.sh) starts two engines on this machine, standing for
two nodes, and a third that remaps user namespaces, imports the default sandbox image into all three and exports
TANGRAM_TEST_DOCKER_NODES (the two nodes) and TANGRAM_TEST_USERNS_ENGINE (the third). Without it these tests fail:
they must not silently skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import docker
import pytest

from sandboxes.backend import LABEL_BROKER, LABEL_ENV, LABEL_MANAGED

NODES_ENV = "TANGRAM_TEST_DOCKER_NODES"
#: a third engine, run with user-namespace remapping (``--userns-remap default``)
USERNS_ENV = "TANGRAM_TEST_USERNS_ENGINE"


def configured_engines() -> list[str]:
    """The engines named in TANGRAM_TEST_DOCKER_NODES (possibly none)."""
    return [u.strip() for u in os.environ.get(NODES_ENV, "").split(",") if u.strip()]


def docker_engines() -> list[str]:
    """The two test engines; fails the test when the test command did not start them."""
    engines = configured_engines()
    if len(engines) < 2:
        pytest.fail(f"{NODES_ENV} must list two Docker engines: run `eval \"$(bash scripts/start-docker.sh)\"` as "
                    f"root (scripts/test.sh does)")
    return engines


def userns_engine() -> str:
    """The test engine that remaps user namespaces; fails the test when the test command did not start it."""
    engine = os.environ.get(USERNS_ENV, "").strip()
    if not engine:
        pytest.fail(f"{USERNS_ENV} must name the Docker engine with user-namespace remapping: run "
                    f"`eval \"$(bash scripts/start-docker.sh)\"` as root (scripts/test.sh does)")
    return engine


#: every broker id this pytest process makes starts with it, so the end-of-suite check looks at this session's
#: sandboxes only, never at those of another session sharing the engines
SESSION_BROKER_PREFIX = f"test-{uuid.uuid4().hex[:6]}-"


def new_broker_id() -> str:
    return SESSION_BROKER_PREFIX + uuid.uuid4().hex[:8]


#: the registries test brokers may pull images from: this machine's (tests/local_registry.py), never another host
LOOPBACK_PULLS = {"pull_from": ["127.0.0.1"]}


def cpu_config(nodes: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A broker config with only the CPU manager's nodes, under a broker id unique to the test, pulling images from
    loopback registries only (``LOOPBACK_PULLS``, under the test's own ``images`` keys)."""
    images = {**LOOPBACK_PULLS, **extra.pop("images", {})}
    return {"cpu": {"broker_id": new_broker_id(), "run_dir": "/run/tangram/test-sandboxes",
                    "nodes": nodes, "images": images, **extra}}


def local_cpu(run_dir: str) -> dict[str, Any]:
    """A ``[cpu]`` section on local processes with one core and small environments, so environments exist (and
    one exec runs at a time) without Docker. ``run_dir`` must be short: executor socket paths fit in 107 bytes."""
    return {"broker_id": new_broker_id(), "run_dir": run_dir, "default_memory_mb": 64,
            "nodes": {"here": {"backend": "local", "unsandboxed": True, "cores": [min(os.sched_getaffinity(0))],
                               "memory_mb": 4096}}}


def labelled_containers(engine: str, broker_id: str | None = None) -> list[Any]:
    labels = [f"{LABEL_MANAGED}=1"] + ([f"{LABEL_BROKER}={broker_id}"] if broker_id else [])
    client = docker.DockerClient(base_url=engine)
    try:
        # ignore_removed: another session sharing the engine may remove a container between list and inspect
        return client.containers.list(all=True, filters={"label": labels}, ignore_removed=True)
    finally:
        client.close()


def kill_sandbox(engine: str, env_id: str) -> None:
    """Kill environment ``env_id``'s container under the broker, as the kernel's OOM killer or an operator would."""
    client = docker.DockerClient(base_url=engine)
    try:
        [container] = client.containers.list(filters={"label": f"{LABEL_ENV}={env_id}"})
        container.kill()
    finally:
        client.close()


#: ``prepare(client)``: a container of the default image, changed as the derived image needs, ready to commit
Prepare = Callable[[docker.DockerClient], Any]


@contextmanager
def derived_images(repository: str, prepare: Prepare) -> Iterator[Mapping[str, str]]:
    """An image of ``repository`` with a tag of its own on each test engine, committed from ``prepare``'s
    container (removed), by engine; the images are removed afterwards."""
    images = {engine: _commit(engine, repository, prepare) for engine in docker_engines()[:2]}
    try:
        yield images
    finally:
        for engine, image in images.items():
            client = docker.DockerClient(base_url=engine)
            try:
                client.images.remove(image, force=True)
            finally:
                client.close()


def _commit(engine: str, repository: str, prepare: Prepare) -> str:
    tag = uuid.uuid4().hex[:8]
    client = docker.DockerClient(base_url=engine)
    try:
        container = prepare(client)
        container.commit(repository=repository, tag=tag)
        container.remove()
    finally:
        client.close()
    return f"{repository}:{tag}"
