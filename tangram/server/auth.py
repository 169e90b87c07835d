"""Bearer tokens on the REST API: principals, token hashing and verification, the middleware, and token management.

A token is 256 random bits (``secrets.token_urlsafe(32)`` behind a ``tgm_`` prefix, so secret scanners can spot
it); only its SHA-256 is ever kept, in the config (``token_sha256``) or in the store's ``tokens`` table. A fast
hash is right for secrets of that strength: nothing can be guessed by trying. Each token belongs to exactly one
task or to the admin. A task's token scopes every request to that task; the admin sees everything and alone
manages the broker (``/v1/admin/*``, and the tasks' SLO plans ``/v1/tasks/.../slo``).

Auth is on when ``[auth] required = true``, or, by default ("auto"), as soon as a token exists in the config or
in the store; otherwise nothing is checked and the broker is as open as it always was. Open in every case:
``/healthz``, ``/readyz`` and ``/openapi.json``. With ``[auth] public_status = true`` (the default) also the status
page, its history, ``GET /v1/resources`` and ``/metrics``: aggregate figures (units, queue depths, ACT), never an
action's id, spec or result, that dashboards and scrapers read without credentials. Otherwise those need a token,
and ``/metrics``, which labels figures by task, the admin's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from aiohttp import web
from pydantic import Field, TypeAdapter

from tangram.config import AccessConfig
from tangram.core.errors import BadRequest, Conflict, Forbidden, NotFound, Unauthorized
from tangram.core.names import Name
from tangram.core.schema import Schema, parse_json
from tangram.server.common import BROKER, json_response, read_body
from tangram.store.store import Store
from tangram.store.tokens import StoredToken

log = logging.getLogger("tangram.server.auth")

TOKEN_PREFIX = "tgm_"
#: routes that answer everyone, auth on or off
ALWAYS_OPEN = frozenset({"/healthz", "/readyz", "/openapi.json"})
#: routes of aggregate status, open while ``public_status``
STATUS = frozenset({"/", "/ui", "/ui/{asset}", "/v1/status/history", "/v1/resources", "/metrics"})
#: routes only the admin may call (``/metrics`` only while status is not public)
ADMIN_PREFIX = "/v1/admin/"
ADMIN_ROUTES = frozenset({"/v1/tasks/slo", "/v1/tasks/{task}/slo"})
#: routes whose callers may not be able to send a header (SandboxFusion's clients post to a bare URL): the token may
#: come as ``?token=`` instead (proxies may log URLs: prefer the header where the client can send one)
TOKEN_IN_QUERY = frozenset({"/run_code"})
#: verification looks tokens up by the first hex digits of their hash, then compares whole digests in constant time
BUCKET_DIGITS = 8


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a task's token (``task``), the admin, or anyone (auth off, or an open route)."""

    task: str | None
    admin: bool = False


ANYONE = Principal(task=None)
ADMIN = Principal(task=None, admin=True)


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def mint(task: str | None, note: str) -> tuple[StoredToken, str]:
    """A new token for ``task`` (None: the admin): the row to store, which holds only its hash, and the token."""
    token = new_token()
    row = StoredToken(id="tok_" + secrets.token_hex(8), sha256=token_sha256(token), task=task, note=note,
                      created_at=time.time())
    return row, token


@dataclass(frozen=True, slots=True)
class _Entry:
    sha256: str
    principal: Principal


class Authenticator:
    """The tokens a broker accepts: those of its config and the store's, refreshed every ``auth.refresh_s``."""

    def __init__(self, access: AccessConfig, store: Store) -> None:
        self.access = access
        self.store = store
        self._stored: dict[str, StoredToken] = {}
        self._store_ever_held = False
        self._buckets: dict[str, list[_Entry]] = {}
        self._changes = 0  # tokens made or revoked here; a refresh that began before one does not overwrite it
        self._rebuild()

    @property
    def enabled(self) -> bool:
        required = self.access.auth.required
        if required is not None:
            return required
        return bool(self.access.auth.admin_token_sha256 or self.access.task_tokens or self._store_ever_held)

    def configure(self, access: AccessConfig) -> None:
        """Use the tokens and settings of a (re-read) config from now on."""
        self.access = access
        self._rebuild()

    async def refresh(self) -> None:
        """Read the store's tokens again (those ``tangram token`` made or revoked from another process)."""
        changes = self._changes
        tokens = await self.store.load_tokens()
        if changes == self._changes:
            self._stored = {token.id: token for token in tokens}
            self._store_ever_held = self._store_ever_held or bool(tokens)
            self._rebuild()

    def _rebuild(self) -> None:
        auth = self.access.auth
        entries = [_Entry(digest, ADMIN) for digest in auth.admin_token_sha256]
        entries += [_Entry(digest, Principal(task)) for task, digests in self.access.task_tokens.items()
                    for digest in digests]
        entries += [_Entry(token.sha256, ADMIN if token.task is None else Principal(token.task))
                    for token in self._stored.values() if token.revoked_at is None]
        buckets: dict[str, list[_Entry]] = {}
        for entry in entries:
            buckets.setdefault(entry.sha256[:BUCKET_DIGITS], []).append(entry)
        self._buckets = buckets

    def verify(self, header: str | None) -> Principal:
        """The principal of an ``Authorization`` header, or ``Unauthorized``."""
        if header is None:
            raise Unauthorized("missing; send 'Authorization: Bearer <token>'", invalid=False)
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("must be 'Bearer <token>'", invalid=True)
        digest = token_sha256(token)
        for entry in self._buckets.get(digest[:BUCKET_DIGITS], ()):
            if hmac.compare_digest(entry.sha256, digest):
                return entry.principal
        raise Unauthorized("unknown or revoked token", invalid=True)

    async def create(self, task: str | None, note: str) -> tuple[StoredToken, str]:
        """A new token for ``task`` (None: the admin), valid at once; returns its row and the token itself, which
        is nowhere kept."""
        row, token = mint(task, note)
        await self.store.add_token(row)
        self._changes += 1
        self._stored[row.id] = row
        self._store_ever_held = True
        self._rebuild()
        return row, token

    async def revoke(self, token_id: str) -> StoredToken:
        """Revoke a stored token at once; a config token is removed from the file instead."""
        if token_id in self._config_ids():
            raise Conflict("id", "this token is in the config (the file, or $TANGRAM_ADMIN_TOKEN_SHA256 for an admin): "
                                 "remove its hash there, then restart or POST /v1/admin/reload")
        row = await self.store.revoke_token(token_id, time.time())
        if row is None:
            raise NotFound("id", f"no token {token_id!r}")
        self._changes += 1
        self._stored[row.id] = row
        self._rebuild()
        return row

    def _config_ids(self) -> list[str]:
        ids = [f"config:admin:{i}" for i in range(len(self.access.auth.admin_token_sha256))]
        return ids + [f"config:{task}:{i}" for task, digests in self.access.task_tokens.items()
                      for i in range(len(digests))]

    def describe(self) -> list[dict[str, Any]]:
        """Every token the broker knows (never a hash): the config's, then the store's, revoked ones included."""
        owners = [None] * len(self.access.auth.admin_token_sha256) + [
            task for task, digests in self.access.task_tokens.items() for _ in digests]
        rows = [{"id": token_id, "task": task, "admin": task is None, "source": "config", "note": "",
                 "created_at": None, "revoked_at": None} for token_id, task in zip(self._config_ids(), owners)]
        return rows + [token_json(token) for token in self._stored.values()]


def token_json(token: StoredToken) -> dict[str, Any]:
    return {"id": token.id, "task": token.task, "admin": token.task is None, "source": "store", "note": token.note,
            "created_at": token.created_at, "revoked_at": token.revoked_at}


AUTH = web.AppKey("auth", Authenticator)
PRINCIPAL = web.RequestKey("principal", Principal)


@web.middleware
async def authenticate(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Set ``request[PRINCIPAL]``, or answer 401/403 (404 for admin routes while auth is off)."""
    auth = request.app[AUTH]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else ""
    admin_route = route.startswith(ADMIN_PREFIX) or route in ADMIN_ROUTES
    if route in ALWAYS_OPEN or (not auth.enabled and not admin_route):
        principal = ANYONE
    elif not auth.enabled:
        raise NotFound("path", "the admin API exists only while auth is on: configure an admin token "
                               "([auth] admin_token_sha256, or `tangram token create --admin`)")
    elif route in STATUS and auth.access.auth.public_status:
        principal = ANYONE
    else:
        header = request.headers.get("Authorization")
        if header is None and route in TOKEN_IN_QUERY and "token" in request.query:
            header = f"Bearer {request.query['token']}"
        principal = auth.verify(header)
        if (admin_route or route == "/metrics") and not principal.admin:
            raise Forbidden("authorization", "this endpoint needs an admin token")
    request[PRINCIPAL] = principal
    return await handler(request)


def principal_of(request: web.Request) -> Principal:
    return request[PRINCIPAL]


def own_task(task: str | None, principal: Principal, field: str = "task") -> str | None:
    """The task a typed request names, under ``principal``: a task token's own when absent, 403 when another."""
    if principal.task is None or task is None:
        return task or principal.task
    if task != principal.task:
        raise Forbidden(field, f"this token belongs to task {principal.task!r}")
    return task


def required_task(task: str | None, principal: Principal) -> str:
    """``own_task`` for a request that cannot go without one: 400 when neither the body nor the token names it."""
    owned = own_task(task, principal)
    if owned is None:
        raise BadRequest("task", "is required")
    return owned


def listed_task(request: web.Request) -> str | None:
    """The task a listing covers: the query's ``task`` (None: every task), which a task token may only name as its
    own (403 otherwise) and fills in when absent."""
    task = request.query.get("task")
    own = principal_of(request).task
    if own is None:
        return task
    if task not in (None, own):
        raise Forbidden("task", f"this token belongs to task {own!r}")
    return own


async def refreshing(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: load the store's tokens before serving, then re-read them every ``auth.refresh_s``."""
    auth = app[AUTH]
    await auth.refresh()

    async def loop() -> None:
        while True:
            await asyncio.sleep(auth.access.auth.refresh_s)
            try:
                await auth.refresh()
            except Exception as error:  # noqa: BLE001 - the store is down: keep the tokens known, try again
                log.error("tokens not refreshed from the store: %r", error)

    task = asyncio.create_task(loop(), name="tangram-auth-refresh")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# -- token management: /v1/admin/tokens ----------------------------------------------------------------------

class TokenRequest(Schema):
    """A token for one task, or for the admin."""

    task: Name | None = None
    admin: bool | None = None
    note: Annotated[str, Field(max_length=256)] | None = None


TOKEN_REQUEST = TypeAdapter(TokenRequest)


async def create_token(request: web.Request) -> web.Response:
    body = parse_json(TOKEN_REQUEST, await read_body(request))
    task, note = body.task, body.note or ""
    if bool(body.admin) == (task is not None):
        raise BadRequest("task", "a token belongs to exactly one task or to the admin: give task or admin: true")
    row, token = await request.app[AUTH].create(task, note)
    # the only answer that ever holds the token: no cache, proxy or browser may keep it
    return json_response({**token_json(row), "token": token}, status=201, headers={"Cache-Control": "no-store"})


async def list_tokens(request: web.Request) -> web.Response:
    return json_response({"tokens": request.app[AUTH].describe()})


async def revoke_token(request: web.Request) -> web.Response:
    return json_response(token_json(await request.app[AUTH].revoke(request.match_info["id"])))


def add_auth(app: web.Application, access: AccessConfig) -> None:
    """Check tokens on ``app`` (whose middlewares include ``authenticate``) and serve token management."""
    app[AUTH] = authenticator = Authenticator(access, app[BROKER].store)
    app[BROKER].ledger.authenticated = lambda: authenticator.enabled  # tenants that need not trust each other
    app.cleanup_ctx.append(refreshing)
    app.router.add_post("/v1/admin/tokens", create_token)
    app.router.add_get("/v1/admin/tokens", list_tokens)
    app.router.add_delete("/v1/admin/tokens/{id}", revoke_token)
