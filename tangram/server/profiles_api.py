"""``GET /v1/profiles``: what the broker has learned per (task, action signature): the T1 its scheduler uses for
actions that declare none and, for elastic actions, the fitted speed-up model and the runs behind it, so a user can
see what the broker believes about their actions and why. A task's token sees its own task's profiles only."""

from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Any

from aiohttp import web

from tangram.core.action import Elasticity
from tangram.core.errors import BadRequest
from tangram.sched.speedup import Speedup
from tangram.server.auth import listed_task
from tangram.server.common import BROKER, json_response

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000
#: the model's trust span as an action declaring no efficiency sees it
_UNDECLARED = Elasticity("")


def _limit(request: web.Request) -> int:
    text = request.query.get("limit")
    if text is None:
        return DEFAULT_LIMIT
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
        raise BadRequest("limit", f"must be an integer between 1 and {MAX_LIMIT}, got {text!r}")
    return int(text)


def speedup_json(learned: Speedup | None) -> dict[str, Any] | None:
    """The fitted coefficients and, per (units rounded to 0.1, workers), how many runs and their median seconds."""
    if learned is None or not learned.runs:
        return None
    fit = learned.fit(_UNDECLARED)
    groups: dict[tuple[float, int], list[float]] = defaultdict(list)
    for run in learned.runs:
        groups[(round(run.units, 1), run.workers)].append(run.seconds)
    return {"runs": len(learned.runs), "serial_s": round(fit.serial_s, 6), "scale": round(fit.scale, 6),
            "per_worker_s": round(fit.per_worker_s, 6), "harness_s": round(fit.harness_s, 6),
            "trusted_units": fit.trusted,
            "by_units": [{"units": units, "workers": workers, "runs": len(seconds),
                          "median_s": round(median(seconds), 6)}
                         for (units, workers), seconds in sorted(groups.items())]}


async def list_profiles(request: web.Request) -> web.Response:
    """The most observed profiles first (``limit`` of them; ``total`` counts all that match)."""
    task = listed_task(request)
    limit = _limit(request)
    durations = request.app[BROKER].durations
    matching = sorted(((key, profile) for key, profile in durations.profiles.items() if task is None or key[0] == task),
                      key=lambda item: (-item[1].samples, *item[0]))
    shown = [{"task": t, "signature": signature, "t1_s": round(profile.t1, 6), "samples": profile.samples,
              "speedup": speedup_json(durations.speedups.get((t, signature)))}
             for (t, signature), profile in matching[:limit]]
    return json_response({"profiles": shown, "total": len(matching)})


def add_profile_routes(app: web.Application) -> None:
    app.router.add_get("/v1/profiles", list_profiles)
