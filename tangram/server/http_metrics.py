"""Requests counted and timed by route, for the SRE's dashboards. A route is the path template the request matched
(``/v1/actions/{id}``), never the raw path, and an unknown method is ``other``: what clients send cannot grow the
number of series."""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry

from tangram.action_series import CounterSeries, HistogramSeries, SeriesCollector
from tangram.metrics import SECONDS

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: the route of a request that matched none (a 404, or a 405: a path without that method)
UNMATCHED = "unmatched"


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return UNMATCHED if resource is None else resource.canonical


def http_metrics(registry: CollectorRegistry) -> Middleware:
    """A middleware counting every request in ``registry``; put it first, to see the status the client gets."""
    requests = CounterSeries("tangram_http_requests", "HTTP requests answered, by method, route and status",
                             ("method", "route", "status"))
    seconds = HistogramSeries("tangram_http_request_seconds", "Time to answer an HTTP request (a waiting one "
                              "included)", ("method", "route"), SECONDS)
    registry.register(SeriesCollector((requests, seconds)))

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500  # what aiohttp answers for an exception no middleware turned into a response
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as error:
            status = error.status
            raise
        finally:
            method = request.method if request.method in METHODS else "other"
            route = route_of(request)
            requests.inc((method, route, str(status)))
            seconds.observe((method, route), time.perf_counter() - started)

    return count
