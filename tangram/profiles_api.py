"""``GET /v1/profiles``: the duration profiles the broker has learned per (task, action signature), the T1 its
scheduler uses for actions that declare none, so a user can see what the broker believes about their actions. A
task's token sees its own task's profiles only."""

from __future__ import annotations

from aiohttp import web

from tangram.api_common import BROKER, json_response
from tangram.auth import listed_task
from tangram.errors import BadRequest

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000


def _limit(request: web.Request) -> int:
    text = request.query.get("limit")
    if text is None:
        return DEFAULT_LIMIT
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise BadRequest("limit", f"must be an integer between 1 and {MAX_LIMIT}, got {text!r}")
    return int(text)


async def list_profiles(request: web.Request) -> web.Response:
    """The most observed profiles first (``limit`` of them; ``total`` counts all that match)."""
    task = listed_task(request)
    limit = _limit(request)
    profiles = request.app[BROKER].durations.profiles
    rows = sorted(({"task": t, "signature": signature, "t1_s": round(profile.t1, 6), "samples": profile.samples}
                   for (t, signature), profile in profiles.items() if task is None or t == task),
                  key=lambda row: (-row["samples"], row["task"], row["signature"]))
    return json_response({"profiles": rows[:limit], "total": len(rows)})


def add_profile_routes(app: web.Application) -> None:
    app.router.add_get("/v1/profiles", list_profiles)
