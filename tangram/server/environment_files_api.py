"""``PUT`` and ``GET /v1/environments/{id}/files``: an environment's files at any time, not only at its creation.

A write takes JSON (``{"files": {path: text | {"base64": ...}}}``, as ``spec.files``) or an uncompressed tar
(``application/x-tar``, for a large tree); a read (``?path=``) answers a regular file's bytes, or a tar of a
directory. Both wait for the environment's running commands and hold no cores (``managers/cpu/environment_files.py``
says why they are no actions); paths follow ``spec.files``' rules and are resolved inside the sandbox; both
directions are bounded by ``[cpu.limits] max_files`` and ``max_files_bytes`` (and the body by ``[server]
max_body_bytes``).
"""

from __future__ import annotations

import posixpath

from aiohttp import web
from pydantic import Field, TypeAdapter

from managers.cpu.environment_files import read_file, write_files
from managers.cpu.exec_spec import Files, decode_files, inside_workdir
from managers.cpu.file_tar import files_of_tar
from sandboxes.file_wire import WriteFiles
from tangram.core.errors import BadRequest
from tangram.core.schema import Schema, parse_json
from tangram.server.common import SERVER, json_response, read_body
from tangram.server.environments_api import environment_manager, environment_named

TAR = "application/x-tar"


class FilesRequest(Schema):
    """Files to write into an environment."""

    files: Files = Field(description='relative path -> text or {"base64": "..."}; parent directories are made, an '
                                     'existing file is replaced (and keeps its mode)')


FILES_REQUEST = TypeAdapter(FilesRequest)


async def put_files(request: web.Request) -> web.Response:
    manager = environment_manager(request)
    env = environment_named(request, manager)
    limits = manager.config.limits
    raw = await read_body(request)
    if request.content_type == TAR:
        files = files_of_tar(raw, "files", limits)
    else:
        files = WriteFiles(decode_files(parse_json(FILES_REQUEST, raw).files, "files", limits))
    written = await write_files(manager.environments, env, files, request.app[SERVER].max_wait_s)
    return json_response({"environment": env.id, "files": written.files, "bytes": written.bytes})


async def get_files(request: web.Request) -> web.Response:
    manager = environment_manager(request)
    env = environment_named(request, manager)
    path = request.query.get("path")
    if path is None:
        raise BadRequest("path", 'is required: a relative path in the working directory ("." for all of it)')
    normal = "." if path and posixpath.normpath(path) == "." else inside_workdir(path, "path")
    data = await read_file(manager.environments, env, normal, manager.config.limits.max_files_bytes,
                           request.app[SERVER].max_wait_s)
    return web.Response(body=data.data, content_type=TAR if data.directory else "application/octet-stream")


def add_environment_file_routes(app: web.Application) -> None:
    app.router.add_put("/v1/environments/{id}/files", put_files)
    app.router.add_get("/v1/environments/{id}/files", get_files)
