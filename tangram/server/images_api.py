"""``POST /v1/images/pull``: a task names the images its environments will ask for, and every CPU node in service
starts pulling those it lacks, in the background (issue 38's per-task pre-pull list). The first environment of each
image then starts without waiting for its pull; one that comes before the pull ends joins it
(``sandboxes/image_pull.py``). Nodes that pull nothing (local processes, nodes behind an agent, ``[cpu.images]
pull = false``) say so in the answer."""

from __future__ import annotations

import logging

from aiohttp import web
from pydantic import Field, TypeAdapter

from managers.cpu.exec_spec import Image
from tangram.core.names import Name
from tangram.core.schema import Schema, parse_json
from tangram.server.auth import principal_of, required_task
from tangram.server.common import json_response, read_body
from tangram.server.environments_api import environment_manager

log = logging.getLogger("tangram.server")

#: images one request may name
MAX_PRE_PULL = 256


class PrePullRequest(Schema):
    """Images a task's environments will ask for."""

    task: Name | None = None
    images: list[Image] = Field(min_length=1, max_length=MAX_PRE_PULL)


PRE_PULL_REQUEST = TypeAdapter(PrePullRequest)


async def pre_pull(request: web.Request) -> web.Response:
    manager = environment_manager(request)
    body = parse_json(PRE_PULL_REQUEST, await read_body(request))
    task = required_task(body.task, principal_of(request))
    images = list(dict.fromkeys(body.images))
    nodes = {name: "pulling" if node.backend.prefetch(images) else "not_pulling"
             for name, node in manager.environments.nodes.items() if node.lost is None}
    log.info("task %s: %d image(s) to pre-pull on %d node(s)", task, len(images), len(nodes))
    return json_response({"task": task, "images": images, "nodes": nodes}, status=202)


def add_image_routes(app: web.Application) -> None:
    app.router.add_post("/v1/images/pull", pre_pull)
