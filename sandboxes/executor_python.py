"""A python3 for the executor in images that have none (issue 38): SWE-style images, distroless and scratch-based
ones must work as sandboxes, and the executor is a Python program.

Once per engine, a throwaway container of an image that has python3 (the default sandbox image) copies its
interpreter, self-contained, into a Docker volume (``executor_python_copy.py``); a sandbox whose image lacks python3
mounts that volume read-only and starts the executor through the copy's own dynamic loader, so the image's libc, or
its lack of one, does not matter. A named volume rather than a host directory: it works the same for an engine on
another host (TLS), and the engine keeps it across broker restarts. The volume's name carries the source image's id,
so a rebuilt default image gets a fresh copy. Whether an image has python3 is asked once per image id, by looking
up ``python3`` along the image's ``PATH`` in a created, never started, container.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import posixpath
import time
from collections.abc import Callable, Coroutine, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import Mount

from sandboxes.backend import SandboxError

log = logging.getLogger("tangram.sandboxes.python")

#: where a sandbox that borrows the interpreter mounts its volume
MOUNT_POINT = "/opt/tangram-python"
#: the copy inside the volume (``executor_python_copy.py`` renames it into place when complete)
COPY = f"{MOUNT_POINT}/current"
#: the executor's interpreter in a sandbox that borrows it: the copy's loader, told where the copy's libraries are
#: (for this process only: the commands it runs see the image's own), then the copy's python3 with no site and no
#: ``PYTHON*`` variables (the image's are for the image's python), unbuffered as the executor's log wants
BORROWED = (f"{COPY}/ld.so", "--library-path", f"{COPY}/lib", f"{COPY}/python/bin/python3", "-E", "-s", "-S", "-u")
#: the executor's interpreter in an image that has one
OWN = ("python3",)
VOLUME_PREFIX = "tangram-executor-python-"
LABEL = "tangram.executor-python"
#: the label's value on a probe (a copy's container carries its source image)
PROBE = "probe"
COPY_PROGRAM = Path(__file__).resolve().parent / "executor_python_copy.py"
#: where ``PATH`` leads when the image does not set one (the engine's default)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: symbolic links followed from ``python3`` before giving up on it
MAX_LINKS = 8
COPY_TIMEOUT_S = 300
#: a probe lives for the milliseconds of its stats: one older than this was left by a broker killed meanwhile
PROBE_LEFTOVER_S = 60.0
#: likewise a copy's container, which may run for COPY_TIMEOUT_S
COPY_LEFTOVER_S = COPY_TIMEOUT_S + 60.0


def interpreter_of(container: Container) -> tuple[str, ...]:
    """The executor's interpreter in ``container``: borrowed when it mounts the copy (made so by ``volume_mount``)."""
    mounts = container.attrs.get("Mounts") or []
    return BORROWED if any(mount.get("Destination") == MOUNT_POINT for mount in mounts) else OWN


def volume_mount(volume: str) -> Mount:
    return Mount(MOUNT_POINT, volume, type="volume", read_only=True)


class ExecutorPython:
    """One engine's answers to "has this image python3?" and its volume of the borrowed interpreter."""

    def __init__(self, source_image: str | None, off_loop: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        """``source_image``: the image whose python3 is copied (None: images without python3 are refused);
        ``off_loop(call, *args)`` runs the engine's blocking calls off the event loop."""
        self.source_image = source_image
        self._off_loop = off_loop
        #: by image id: whether it has python3 on its PATH
        self._has_python: dict[str, bool] = {}
        self._volume: asyncio.Task[str] | None = None

    def knows(self, image_id: str, has_python: bool) -> None:
        """Record an image's answer learnt elsewhere (a fork's snapshot has its source's)."""
        self._has_python[image_id] = has_python

    async def volume_for(self, client: docker.DockerClient, image: str) -> str | None:
        """None when ``image`` has python3; else the volume of the borrowed interpreter, made on first need."""
        if not await self._has_python3(client, image):
            if self.source_image is None:
                raise SandboxError("image_without_python3", f"image {image!r} has no python3 on its PATH, and this "
                                                            f"engine has no image to copy one from")
            failed = self._volume is not None and self._volume.done() and (
                self._volume.cancelled() or self._volume.exception() is not None)
            if self._volume is None or failed:
                self._volume = asyncio.create_task(self._off_loop(self._make_volume, client))
            return await asyncio.shield(self._volume)
        return None

    async def _has_python3(self, client: docker.DockerClient, image: str) -> bool:
        image_id, environment = await self._off_loop(_image_id_and_env, client, image)
        known = self._has_python.get(image_id)
        if known is None:
            known = self._has_python[image_id] = await self._off_loop(_finds_python3, client, image, environment)
            if not known:
                log.info("image %s has no python3: its sandboxes' executors borrow %s's", image, self.source_image)
        return known

    def _make_volume(self, client: docker.DockerClient) -> str:
        """The volume holding a complete copy, made by a container of the source image (idempotent: a complete
        copy is left as it is)."""
        assert self.source_image is not None
        source_id = client.images.get(self.source_image).id.split(":")[-1]
        name = VOLUME_PREFIX + source_id[:12]
        client.volumes.create(name, labels={LABEL: self.source_image})
        options = {"network_mode": "none", "user": "0:0", "cap_drop": ["ALL"], "security_opt": ["no-new-privileges"],
                   "mounts": [Mount("/out", name, type="volume")], "labels": {LABEL: self.source_image}}
        container = client.containers.create(self.source_image, ["python3", "-c", COPY_PROGRAM.read_text()],
                                             **options)
        try:
            container.start()
            outcome = container.wait(timeout=COPY_TIMEOUT_S)
            if outcome.get("StatusCode") != 0:
                logs = container.logs(tail=20).decode(errors="replace")
                raise SandboxError("image_without_python3", f"copying python3 from {self.source_image!r} for images "
                                                            f"without one failed: {logs}")
        finally:
            container.remove(force=True)
        return name


def sweep_leftovers(client: docker.DockerClient) -> int:
    """Remove the probe and copy containers a killed broker left (every broker on the engine makes them under the
    same label, so only those past their longest life are taken); how many were removed."""
    now = time.time()
    removed = 0
    for container in client.containers.list(all=True, ignore_removed=True, filters={"label": LABEL}):
        limit = PROBE_LEFTOVER_S if container.labels.get(LABEL) == PROBE else COPY_LEFTOVER_S
        created = _engine_time(container.attrs.get("Created", ""))
        if created is not None and now - created > limit:
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                continue
            log.warning("removed container %s a killed broker left (%s)", container.short_id,
                        container.labels.get(LABEL))
            removed += 1
    return removed


def _engine_time(stamp: str) -> float | None:
    """An engine's UTC timestamp (RFC 3339 to the nanosecond, "Z") in seconds since the epoch; None when unreadable
    (such a container is left alone)."""
    if not stamp.endswith("Z"):
        return None
    try:
        return datetime.fromisoformat(stamp[:-1][:26] + "+00:00").timestamp()
    except ValueError:
        return None


def _image_id_and_env(client: docker.DockerClient, image: str) -> tuple[str, Mapping[str, str]]:
    try:
        attrs = client.images.get(image).attrs
    except docker.errors.ImageNotFound:
        raise SandboxError("image_not_found", f"the engine has no image {image!r}; build the default with `tangram "
                                              f"image build` or `docker load` yours") from None
    pairs = (item.split("=", 1) for item in (attrs.get("Config") or {}).get("Env") or [])
    return attrs["Id"], {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def _finds_python3(client: docker.DockerClient, image: str, environment: Mapping[str, str]) -> bool:
    """Whether ``python3`` resolves along the image's PATH to a file, asked of a created container's filesystem."""
    probe = client.containers.create(image, ["python3"], network_mode="none", labels={LABEL: PROBE})
    try:
        for directory in environment.get("PATH", DEFAULT_PATH).split(":"):
            if directory.startswith("/") and _resolves_to_file(probe, posixpath.join(directory, "python3")):
                return True
        return False
    finally:
        probe.remove(force=True)


def _stat(container: Container, path: str) -> dict[str, Any] | None:
    """The engine's stat of ``path`` in the container (HEAD of its archive: no tar is sent), or None."""
    api = container.client.api
    response = api.head(api._url("/containers/{0}/archive", container.id), params={"path": path})
    if response.status_code == 404:
        return None
    response.raise_for_status()
    entry: dict[str, Any] = json.loads(base64.b64decode(response.headers["X-Docker-Container-Path-Stat"]))
    return entry


def _resolves_to_file(container: Container, path: str) -> bool:
    for _ in range(MAX_LINKS):
        entry = _stat(container, path)
        if entry is None:
            return False
        mode = int(entry["mode"])
        if not mode & (1 << 27):  # Go's os.ModeSymlink: anything else at the path is taken as the program
            return not mode & (1 << 31)  # os.ModeDir
        target = entry.get("linkTarget") or ""
        path = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    return False
