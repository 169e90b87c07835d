"""A Docker Registry HTTP API v2 server of our own on 127.0.0.1, for pull tests on a machine without the internet.

It serves one image, exported from a test engine with ``docker save`` (config and layers as they are, layers
uncompressed, which the engine sniffs), under the names a test gives it, as a schema2 manifest. It counts manifest
requests per (name, reference): an engine's pull asks for the tag it pulls once (then fetches the manifest by
digest), so that a test can check how often the engines pulled, and may require basic auth or a
bearer token. Docker engines allow plain HTTP to registries on 127.0.0.0/8.
"""

from __future__ import annotations

import base64
import hashlib
import json
import tarfile
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import docker
from aiohttp import web

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
LAYER_TYPE = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


@dataclass(frozen=True)
class SavedImage:
    """An image's blobs on disk by digest, and its schema2 manifest."""

    blobs: dict[str, Path]
    manifest: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()

    @classmethod
    def export(cls, engine: str, image: str, directory: Path) -> SavedImage:
        """``docker save`` of ``image`` from ``engine``, unpacked in ``directory``."""
        client = docker.DockerClient(base_url=engine, timeout=300)
        try:
            saved = directory / "image.tar"
            with saved.open("wb") as out:
                for chunk in client.images.get(image).save(named=False):
                    out.write(chunk)
        finally:
            client.close()
        with tarfile.open(saved) as tar:
            tar.extractall(directory, filter="data")
        saved.unlink()
        [entry] = json.loads((directory / "manifest.json").read_text())
        config = directory / entry["Config"]
        blobs = {_sha256(config): config}
        layers = []
        for name in entry["Layers"]:
            path = directory / name
            digest = _sha256(path)
            blobs[digest] = path
            layers.append({"mediaType": LAYER_TYPE, "size": path.stat().st_size, "digest": digest})
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                    "config": {"mediaType": CONFIG_TYPE, "size": config.stat().st_size, "digest": _sha256(config)},
                    "layers": layers}
        return cls(blobs, json.dumps(manifest).encode())


@dataclass
class LocalRegistry:
    """Serves ``image`` as every repository in ``names`` (tags: any); ``basic`` (username, password) or ``token``
    makes it refuse requests without them."""

    image: SavedImage
    names: set[str] = field(default_factory=set)
    basic: tuple[str, str] | None = None
    token: str | None = None
    manifest_requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    refused: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> LocalRegistry:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/v2/", self._root)
        app.router.add_route("*", r"/v2/{name:.+}/manifests/{reference}", self._manifest)
        app.router.add_route("*", r"/v2/{name:.+}/blobs/{digest}", self._blob)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if self.basic is not None:
            expected = "Basic " + base64.b64encode(":".join(self.basic).encode()).decode()
            challenge = 'Basic realm="tangram-test"'
        elif self.token is not None:
            expected, challenge = f"Bearer {self.token}", f'Bearer realm="http://{self.host}/token"'
        else:
            return await handler(request)
        if given != expected:
            self.refused += 1
            return web.json_response({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
                                     status=401, headers={"WWW-Authenticate": challenge})
        return await handler(request)

    async def _root(self, request: web.Request) -> web.Response:
        return web.json_response({}, headers={"Docker-Distribution-API-Version": "registry/2.0"})

    async def _manifest(self, request: web.Request) -> web.Response:
        name, reference = request.match_info["name"], request.match_info["reference"]
        self.manifest_requests[(name, reference)] += 1
        if name not in self.names or reference.startswith("sha256:") and reference != self.image.digest:
            return web.json_response({"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]},
                                     status=404)
        headers = {"Docker-Content-Digest": self.image.digest, "Content-Type": MANIFEST_TYPE}
        body = self.image.manifest if request.method == "GET" else None
        return web.Response(body=body, headers={**headers, "Content-Length": str(len(self.image.manifest))})

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        path = self.image.blobs.get(request.match_info["digest"])
        if request.match_info["name"] not in self.names or path is None:
            return web.json_response({"errors": [{"code": "BLOB_UNKNOWN", "message": "blob unknown"}]}, status=404)
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream",
                                               "Docker-Content-Digest": request.match_info["digest"]})
