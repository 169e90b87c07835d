"""A small search API for load tests: the upstream that the broker's ``api.search`` resource proxies to.

It answers like a web search service, after a delay drawn around ``--delay-ms`` (what a real search API costs):

    GET /search?q=QUERY[&k=N]  ->  {"query": ..., "results": [{"title", "url", "snippet"}, ...]}
    GET /fetch?url=URL         ->  {"url": ..., "text": ...}

Results are made up but deterministic per query, so a trajectory can quote them in its answer.

    python -m loadtest.upstream [--host 127.0.0.1] [--port 8391] [--delay-ms 50]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random

from aiohttp import web

MAX_RESULTS = 20
TOPICS = ("python packaging", "unit testing", "asyncio", "docker cgroups", "gpu scheduling", "reward models",
          "sentence embeddings", "rate limits", "linux namespaces", "sql indexes")


def _bad_request(field: str, reason: str) -> web.Response:
    return web.json_response({"error": {"field": field, "reason": reason}}, status=400)


def _topic(text: str) -> str:
    return TOPICS[int(hashlib.sha256(text.encode()).hexdigest(), 16) % len(TOPICS)]


class SearchApi:
    """The handlers, with the delay each request waits before it answers."""

    def __init__(self, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay must be >= 0 seconds, not {delay_s}")
        self.delay_s = delay_s

    async def _delay(self) -> None:
        await asyncio.sleep(self.delay_s * random.uniform(0.5, 1.5))

    async def search(self, request: web.Request) -> web.Response:
        query = request.query.get("q", "").strip()
        if not query:
            return _bad_request("q", "a non-empty query is required")
        try:
            k = int(request.query.get("k", "5"))
        except ValueError:
            return _bad_request("k", "must be an integer")
        if not 1 <= k <= MAX_RESULTS:
            return _bad_request("k", f"must be between 1 and {MAX_RESULTS}")
        await self._delay()
        topic = _topic(query)
        results = [{"title": f"{topic.title()}: notes {i + 1}",
                    "url": f"https://docs.example/{topic.replace(' ', '-')}/{i + 1}",
                    "snippet": f"An explanation of {topic} relevant to '{query}' (part {i + 1})."}
                   for i in range(k)]
        return web.json_response({"query": query, "results": results})

    async def fetch(self, request: web.Request) -> web.Response:
        url = request.query.get("url", "")
        if not url.startswith(("http://", "https://")):
            return _bad_request("url", "an http(s) URL is required")
        await self._delay()
        topic = _topic(url)
        return web.json_response({"url": url, "text": f"This page explains {topic} in detail. " * 8})


def search_app(delay_s: float) -> web.Application:
    api = SearchApi(delay_s)
    app = web.Application()
    app.router.add_get("/search", api.search)
    app.router.add_get("/fetch", api.fetch)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="typical answer delay (uniform 0.5x-1.5x)")
    args = parser.parse_args(argv)
    web.run_app(search_app(args.delay_ms / 1000), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
