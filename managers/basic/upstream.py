"""The HTTP proxy behind ``api`` actions: one fixed upstream per resource, bounded retries, capped bodies.

An action never names a host: its ``spec`` gives a method, a path under the resource's ``base_url``, a query,
headers and a body, and is validated at submit so a bad one is a 400 naming the field, not a failed action.
Retries (429 / 5xx / connection errors / per-attempt timeouts) call ``before_retry`` first, which the Basic
manager uses to take another quota unit, so a retry is still a counted call against the upstream's rate limit.
A broker that no longer leads sends no attempt (``tangram/core/fencing.py``: the upstream cannot check an epoch).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import aiohttp
from pydantic import AfterValidator, Discriminator, Field, Strict, Tag, TypeAdapter
from yarl import URL

from managers.basic.upstream_metrics import NO_ANSWER, UpstreamMetrics
from tangram.core.config_tables import TABLE, Count, NonNegative, PositiveSeconds, Seconds
from tangram.core.errors import ActionFailed, Unprocessable
from tangram.core.fencing import current
from tangram.core.names import json_pattern
from tangram.core.schema import Schema, explained, parse, tag
from tangram_client.retry import backoff_s, retry_after_s

#: never forwarded: connection-level headers, and those the client library must compute for the real upstream
DROPPED_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                             "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
                             "content-length"})
#: response headers worth showing the client (the rest describe the upstream's connection, not the answer)
RESULT_HEADERS = frozenset({"content-type", "content-language", "etag", "last-modified", "cache-control",
                            "location", "retry-after"})
MAX_RETRY_AFTER_S = 60.0
MAX_PATH_CHARS = 2048
HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")  # \Z: "$" would let a final newline through
#: a path that stays under the upstream's base, as a grammar the document states: one leading '/', then segments
#: that are not empty, '.' or '..' (nor those written with %2e), of any character but '?', '#', '\\', '/', space and
#: control characters, '%' only as an escape (%XX); a trailing '/' is allowed. Parameters go in ``spec.query``.
_DOT = r"(?:\.|%2[eE])"
_NOT_DOT = r"(?:[^/?#\\%.\x00-\x20\x7f]|%(?:[013-9A-Fa-f][0-9A-Fa-f]|2[0-9A-Da-dFf]))"
_SEGMENT = rf"(?:{_DOT}*{_NOT_DOT}(?:{_DOT}|{_NOT_DOT})*|{_DOT}{{3,}})"
API_PATH = re.compile(rf"^/(?:{_SEGMENT}(?:/{_SEGMENT})*/?)?\Z")
API_PATH_REASON = ("must be a path under the upstream: a single leading '/', no empty, '.' or '..' segments, no '?', "
                   "'#', '\\', spaces or control characters, '%' only as %XX (put parameters in spec.query)")
READ_CHUNK = 64 * 1024


def _base_url(url: str) -> str:
    try:
        base = URL(url)
    except (TypeError, ValueError):
        raise ValueError("must be an http(s) URL") from None
    if base.scheme not in ("http", "https") or not base.host:
        raise ValueError("must be an absolute http:// or https:// URL with a host")
    if base.query_string or base.fragment or base.user:
        raise ValueError("must not carry credentials, a query or a fragment")
    return url


@dataclass(frozen=True)
class UpstreamConfig:
    """``[basic.NAME.upstream]``: where the resource's ``api`` actions go."""

    __pydantic_config__ = TABLE

    #: e.g. "http://127.0.0.1:8081"; actions can never name another host
    base_url: Annotated[str, Strict(), AfterValidator(_base_url)]
    timeout_s: PositiveSeconds = 30.0  # per attempt
    max_retries: NonNegative = 3  # on 429 / 5xx / connection errors
    backoff_s: Seconds = 0.1  # base of exponential backoff with jitter; Retry-After honoured when <= 60 s
    max_body_bytes: Count = 1 << 20  # response body cap; larger -> ActionFailed("upstream_body_too_large")


def _query_form(value: Any) -> str | None:
    if isinstance(value, str):
        return tag("text")
    return tag("number") if isinstance(value, (int, float)) and not isinstance(value, bool) else None


QueryValue = Annotated[Annotated[str, Tag(tag("text"))] | Annotated[float, Tag(tag("number"))],
                       Discriminator(_query_form, custom_error_type="query_value",
                                     custom_error_message="must be a string or a finite number")]


class ApiSpec(Schema):
    """An api action's ``spec``: one HTTP call under the resource's upstream (never another host)."""

    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"] | None = None
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS, pattern=explained(json_pattern(API_PATH),
                                                                                API_PATH_REASON),
                      description="a path under the resource's upstream, starting with '/'")
    query: dict[str, QueryValue] | None = None
    headers: dict[Annotated[str, Field(pattern=explained(json_pattern(HEADER_NAME), "is not a valid header name"))],
                  Annotated[str, Field(pattern=explained("^[^\r\n\x00]*$", "must not contain CR, LF or NUL"))]
                  ] | None = None
    body: Any = Field(default=None, description="a JSON body")
    body_text: str | None = Field(default=None, description="a text body (not with body)")


API_SPEC = TypeAdapter(ApiSpec)


def validate_spec(spec: Mapping[str, Any]) -> None:
    """Reject an ``api`` spec the proxy would refuse or that could reach anything but the configured upstream."""
    body = parse(API_SPEC, spec, "spec")
    if body.body_text is not None and "body" in spec:
        raise Unprocessable("spec.body_text", "give either spec.body (JSON) or spec.body_text, not both")


class Upstream:
    """Sends validated specs to one upstream over a session the manager owns."""

    def __init__(self, config: UpstreamConfig, api: str, metrics: UpstreamMetrics) -> None:
        """``api``: the resource it serves, as the metrics name it."""
        self.config = config
        self._retries = metrics.retries.labels(api)
        self._responses = metrics.responses
        self._api = api
        self._base = URL(config.base_url)
        self._prefix = self._base.path.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)

    def url(self, path: str) -> URL:
        """The upstream URL for a validated path; the host always is the configured one."""
        return self._base.with_path(self._prefix + path)

    async def call(self, session: aiohttp.ClientSession, spec: Mapping[str, Any],
                   before_retry: Callable[[], Awaitable[None]]) -> dict[str, Any]:
        """Proxy one call; a final non-retryable answer (2xx-4xx) is a result, exhausted retries raise."""
        method = spec.get("method", "GET")
        url = self.url(spec["path"])
        headers = {k: v for k, v in spec.get("headers", {}).items() if k.lower() not in DROPPED_HEADERS}
        params = {k: str(v) for k, v in spec.get("query", {}).items()}
        body: dict[str, Any] = {}
        if "body" in spec:
            body["json"] = spec["body"]
        elif "body_text" in spec:
            body["data"] = spec["body_text"].encode()
        attempts = 0
        last_status: int | None = None
        last_error = ""
        delay = 0.0
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(delay)
                await before_retry()
                self._retries.inc()
            current().check()  # right before the side effect: a deposed leader's action fails with "deposed"
            attempts += 1
            try:
                # Redirects are not followed: a Location could name any host.
                async with session.request(method, url, params=params, headers=headers, timeout=self._timeout,
                                           allow_redirects=False, **body) as resp:
                    self._responses.labels(self._api, str(resp.status)).inc()
                    if not _retryable(resp.status):
                        raw = await self._read_capped(resp, attempts)
                        return {"status": resp.status, "headers": _result_headers(resp.headers),
                                "body": _decode(resp, raw), "attempts": attempts}
                    last_status, last_error = resp.status, f"HTTP {resp.status}"
                    asked = _retry_after(resp) if resp.status in (429, 503) else None
                    delay = self._backoff(attempt) if asked is None else asked
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._responses.labels(self._api, NO_ANSWER).inc()
                last_status = None
                last_error = f"timed out after {self.config.timeout_s} s" if isinstance(exc, TimeoutError) \
                    else f"{type(exc).__name__}: {exc}"
                delay = self._backoff(attempt)
        raise ActionFailed("upstream_unavailable", f"{method} {spec['path']}: {last_error} after {attempts} attempts",
                           status=last_status, attempts=attempts)

    def _backoff(self, attempt: int) -> float:
        return backoff_s(attempt, self.config.backoff_s, MAX_RETRY_AFTER_S)

    async def _read_capped(self, resp: aiohttp.ClientResponse, attempts: int) -> bytes:
        cap = self.config.max_body_bytes
        too_large = ActionFailed("upstream_body_too_large", f"upstream response body exceeds {cap} bytes",
                                 limit=cap, status=resp.status, attempts=attempts)
        if resp.content_length is not None and resp.content_length > cap:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(READ_CHUNK):
            size += len(chunk)
            if size > cap:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    """Seconds the upstream asked us to wait, if given and short enough to wait inside one action."""
    seconds = retry_after_s(resp.headers.get("Retry-After"))
    return seconds if seconds is not None and seconds <= MAX_RETRY_AFTER_S else None


def _result_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()
            if k.lower() in RESULT_HEADERS or k.lower().startswith("x-ratelimit-")}


def _decode(resp: aiohttp.ClientResponse, raw: bytes) -> Any:
    """JSON when the upstream says so (and it parses), text otherwise."""
    ctype = resp.content_type
    if ctype == "application/json" or ctype.endswith("+json"):
        try:
            return json.loads(raw)
        except ValueError:
            pass
    try:
        return raw.decode(resp.charset or "utf-8", errors="replace")
    except LookupError:
        return raw.decode("utf-8", errors="replace")

