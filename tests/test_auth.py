"""Tenants and tokens over real HTTP: 401 without a valid token, a task's token scoped to its task (403 on another
task's name, 404 on another task's ids), admin-only management, tokens from the config and from the store (made
by the admin API or the CLI, kept only as SHA-256, revocable), drain and reload through the admin API."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import create_async_engine

from tangram.config import parse_config
from tangram.core.errors import ConfigError
from tangram.server.auth import mint, new_token, token_sha256
from tangram.store.store import Store
from tangram.store.tables import TokenRow
from tangram.store.tokens import StoredToken
from tangram_client import AsyncTangramClient
from tangram_client.errors import ForbiddenError, NotFoundError, UnauthorizedError
from tests.docker_nodes import local_cpu
from tests.harness import broker_from_file, live_broker

ADMIN, TOKEN_A, TOKEN_B = new_token(), new_token(), new_token()
LEASES = {"basic": {"lease.x": {"concurrency": 4, "lease_ttl_s": 30.0}}, "cpu": {"enabled": False}}


def secured(**auth: Any) -> dict[str, Any]:
    """The lease broker with an admin token and tokens for tasks a and b, all from the config as hashes."""
    return {**LEASES, "auth": {"admin_token_sha256": token_sha256(ADMIN), **auth},
            "tasks": {"a": {"token_sha256": [token_sha256(TOKEN_A)]}, "b": {"token_sha256": token_sha256(TOKEN_B)}}}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def lease(**extra: Any) -> dict[str, Any]:
    return {"kind": "lease", "demand": {"lease.x": 1}, **extra}


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


def write_config(path: Path, db_path: str, tasks: str) -> None:
    path.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{db_path}"\n[cpu]\nenabled = false\n'
                    f'[basic."lease.x"]\nconcurrency = 4\n[auth]\nadmin_token_sha256 = "{token_sha256(ADMIN)}"\n'
                    f"{tasks}")


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tangram.cli", *args], input=stdin, capture_output=True, text=True,
                          check=False, timeout=60)


# -- 401 and what stays open ------------------------------------------------------------------------------------

PROTECTED = [("POST", "/v1/actions"), ("POST", "/v1/actions:batch"), ("GET", "/v1/actions/act_x"),
             ("DELETE", "/v1/actions/act_x"), ("DELETE", "/v1/leases/act_x"), ("GET", "/v1/environments"),
             ("GET", "/v1/services"), ("POST", "/v1/admin/drain"), ("GET", "/v1/admin/tokens"),
             ("GET", "/v2/unknown")]


async def test_without_a_valid_token_every_api_route_is_401_and_health_stays_open(db):
    async with live_broker(secured(), db) as live:
        for header in (None, "Basic YTpi", "Bearer", "Bearer " + new_token(), "Bearer " + token_sha256(TOKEN_A)):
            for method, path in PROTECTED:
                headers = {"Authorization": header} if header else {}
                async with live.http.request(method, live.url + path, headers=headers, json=lease()) as response:
                    body = await response.json()
                    assert response.status == 401, (header, method, path, body)
                    assert body["error"]["field"] == "authorization" and body["error"]["reason"]
                    assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert not live.broker.actions
        for path in ("/healthz", "/openapi.json", "/v1/resources", "/v1/status/history", "/metrics", "/ui"):
            code, _ = await live.call("GET", path)
            assert code == 200, path
        _, document = await live.call("GET", "/openapi.json")
        assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert "401" in document["paths"]["/v1/actions"]["post"]["responses"]
        assert document["paths"]["/healthz"]["get"]["security"] == []
        assert "/v1/admin/tokens" in document["paths"]


async def test_status_routes_need_a_token_when_not_public_and_metrics_the_admins(db):
    async with live_broker(secured(public_status=False), db) as live:
        for path in ("/v1/resources", "/v1/status/history", "/ui", "/metrics"):
            assert (await live.call("GET", path))[0] == 401, path
        assert (await live.call("GET", "/v1/resources", headers=bearer(TOKEN_A)))[0] == 200
        code, reply = await live.call("GET", "/metrics", headers=bearer(TOKEN_A))
        assert (code, reply["error"]["field"]) == (403, "authorization")
        code, text = await live.call("GET", "/metrics", headers=bearer(ADMIN))
        assert code == 200 and "tangram_units_capacity" in text
        assert (await live.call("GET", "/healthz"))[0] == 200


async def test_an_open_broker_ignores_tokens_and_has_no_admin_api(db):
    async with live_broker(LEASES, db) as live:
        code, record = await live.call("POST", "/v1/actions", json=lease(task="anyone"))
        assert code == 201 and record["task"] == "anyone"
        code, reply = await live.call("POST", "/v1/admin/drain", headers=bearer(ADMIN))
        assert (code, reply["error"]["field"]) == (404, "path") and "auth" in reply["error"]["reason"]
        _, document = await live.call("GET", "/openapi.json")
        assert "securitySchemes" not in document["components"] and "/v1/admin/drain" not in document["paths"]


# -- scoping ----------------------------------------------------------------------------------------------------

async def test_a_task_token_fills_in_its_task_and_may_not_name_another(db):
    async with live_broker(secured(), db) as live:
        code, record = await live.call("POST", "/v1/actions", json=lease(), headers=bearer(TOKEN_A))
        assert code == 201 and record["task"] == "a"
        code, record = await live.call("POST", "/v1/actions", json=lease(task="a"), headers=bearer(TOKEN_A))
        assert code == 201 and record["task"] == "a"
        code, reply = await live.call("POST", "/v1/actions", json=lease(task="b"), headers=bearer(TOKEN_A))
        assert (code, reply["error"]["field"]) == (403, "task") and "'a'" in reply["error"]["reason"]
        code, reply = await live.call("POST", "/v1/actions:batch", headers=bearer(TOKEN_A),
                                      json={"actions": [lease(), lease(task="b")]})
        assert (code, reply["error"]["field"]) == (403, "actions[1].task")
        assert len(live.broker.actions) == 2  # nothing of the refused batch
        code, reply = await live.call("POST", "/v1/actions", json=lease(task="b"), headers=bearer(ADMIN))
        assert code == 201 and reply["task"] == "b"  # the admin acts for any task, naming it


async def test_another_tasks_actions_and_leases_are_as_missing_as_unknown_ids(db):
    async with live_broker(secured(), db) as live:
        code, granted = await live.call("POST", "/v1/actions?wait=true", json=lease(idempotency_key="k"),
                                        headers=bearer(TOKEN_A))
        assert code == 200 and granted["state"] == "succeeded"
        action_id = granted["id"]
        missing = {"error": {"field": "id", "reason": f"no action {action_id!r}"}}
        for method, path in (("GET", f"/v1/actions/{action_id}"), ("GET", f"/v1/actions/{action_id}?wait=true"),
                             ("DELETE", f"/v1/actions/{action_id}"), ("DELETE", f"/v1/leases/{action_id}")):
            assert await live.call(method, path, headers=bearer(TOKEN_B)) == (404, missing), (method, path)
        code, unknown = await live.call("GET", "/v1/actions/act_missing", headers=bearer(TOKEN_B))
        assert (code, unknown) == (404, {"error": {"field": "id", "reason": "no action 'act_missing'"}})
        # the same idempotency key is another task's own key: a new action, not a's
        code, other = await live.call("POST", "/v1/actions", json=lease(idempotency_key="k"), headers=bearer(TOKEN_B))
        assert code == 201 and other["id"] != action_id and other["task"] == "b"
        assert (await live.call("GET", f"/v1/actions/{action_id}", headers=bearer(ADMIN)))[0] == 200
        code, released = await live.call("DELETE", f"/v1/leases/{action_id}", headers=bearer(TOKEN_A))
        assert code == 200 and released["result"]["returned"] == "released"


async def test_another_tasks_environments_are_as_missing_as_unknown_ones(db, run_dir):
    async with live_broker({**secured(), "cpu": local_cpu(run_dir)}, db) as live:
        code, env = await live.call("POST", "/v1/environments", json={"trajectory": "t1"}, headers=bearer(TOKEN_A))
        assert code == 201 and env["task"] == "a"
        code, reply = await live.call("POST", "/v1/environments", json={"task": "a"}, headers=bearer(TOKEN_B))
        assert (code, reply["error"]["field"]) == (403, "task")
        missing = {"error": {"field": "id", "reason": f"no environment {env['id']!r}"}}
        for method in ("GET", "DELETE"):
            assert await live.call(method, f"/v1/environments/{env['id']}", headers=bearer(TOKEN_B)) == (404, missing)
        assert (await live.call("GET", "/v1/environments", headers=bearer(TOKEN_B)))[1] == {"environments": []}
        code, reply = await live.call("GET", "/v1/environments?task=a", headers=bearer(TOKEN_B))
        assert (code, reply["error"]["field"]) == (403, "task")
        code, reply = await live.call("POST", "/v1/actions", headers=bearer(TOKEN_B), json={
            "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "true", "environment": env["id"]}})
        assert (code, reply["error"]["field"]) == (404, "spec.environment")
        _, mine = await live.call("GET", "/v1/environments", headers=bearer(TOKEN_A))
        _, everything = await live.call("GET", "/v1/environments", headers=bearer(ADMIN))
        assert [e["id"] for e in mine["environments"]] == [e["id"] for e in everything["environments"]] == [env["id"]]
        assert (await live.call("DELETE", f"/v1/environments/{env['id']}", headers=bearer(TOKEN_A)))[0] == 200


async def test_the_python_client_sends_its_token(db):
    async with live_broker(secured(), db) as live:
        async with AsyncTangramClient(live.url, task="a", token=TOKEN_A) as client:
            record = await client.lease({"lease.x": 1}, ttl_s=30)
            assert record.raw["task"] == "a"
        async with AsyncTangramClient(live.url, task="b", token=TOKEN_B) as client:
            with pytest.raises(NotFoundError):
                await client.get(record.id)
        async with AsyncTangramClient(live.url, task="a", token=new_token()) as client:
            with pytest.raises(UnauthorizedError) as error:
                await client.get(record.id)
            assert (error.value.status, error.value.field) == (401, "authorization")
        async with AsyncTangramClient(live.url, task="b", token=TOKEN_B) as client:
            with pytest.raises(ForbiddenError) as forbidden:
                await client.submit("lease", {"lease.x": 1}, {"ttl_s": 30}, task="a")
            assert forbidden.value.field == "task"


# -- the admin API ----------------------------------------------------------------------------------------------

ADMIN_ROUTES = [("POST", "/v1/admin/drain"), ("POST", "/v1/admin/reload"), ("GET", "/v1/admin/tokens"),
                ("POST", "/v1/admin/tokens"), ("DELETE", "/v1/admin/tokens/tok_x")]


async def test_admin_routes_refuse_task_tokens(db):
    async with live_broker(secured(), db) as live:
        for method, path in ADMIN_ROUTES:
            code, reply = await live.call(method, path, json={"task": "a"}, headers=bearer(TOKEN_A))
            assert (code, reply["error"]["field"]) == (403, "authorization"), (method, path)
        assert not live.broker.draining
        assert (await live.call("GET", "/v1/resources", headers=bearer(TOKEN_A)))[0] == 200


async def test_drain_by_the_admin_stops_taking_actions(db):
    async with live_broker(secured(), db) as live:
        code, reply = await live.call("POST", "/v1/admin/drain", json={"timeout_s": -1}, headers=bearer(ADMIN))
        assert (code, reply["error"]["field"]) == (400, "timeout_s") and not live.broker.draining
        code, reply = await live.call("POST", "/v1/admin/drain", json={"timeout_s": 5}, headers=bearer(ADMIN))
        assert (code, reply) == (200, {"draining": True, "running": 0, "queued": 0})
        code, reply = await live.call("POST", "/v1/actions", json=lease(), headers=bearer(TOKEN_A))
        assert code == 503 and "shutting down" in reply["error"]["reason"]


async def read_token_rows(store_url: str) -> list[dict[str, Any]]:
    engine = create_async_engine(store_url)
    try:
        async with engine.connect() as conn:
            return [dict(row._mapping) for row in await conn.execute(select(TokenRow.__table__))]
    finally:
        await engine.dispose()


async def test_admin_tokens_are_stored_hashed_survive_restarts_and_revoke_at_once(store_url):
    config = secured()
    async with live_broker(config, "", store_url=store_url) as live:
        for body in ({}, {"task": "c", "admin": True}, {"task": "c", "colour": 1}, {"task": "bad name"}):
            code, _ = await live.call("POST", "/v1/admin/tokens", json=body, headers=bearer(ADMIN))
            assert code == 400, body
        # a null field is a field not given (admin: null is no admin token)
        code, made = await live.call("POST", "/v1/admin/tokens", json={"task": "c", "note": "ci", "admin": None},
                                     headers=bearer(ADMIN))
        assert code == 201 and made["task"] == "c" and made["token"].startswith("tgm_")
        token = made["token"]
        code, record = await live.call("POST", "/v1/actions", json=lease(), headers=bearer(token))
        assert code == 201 and record["task"] == "c"
        _, listed = await live.call("GET", "/v1/admin/tokens", headers=bearer(ADMIN))
        assert [t["id"] for t in listed["tokens"]] == ["config:admin:0", "config:a:0", "config:b:0", made["id"]]
        assert all("token" not in t and "sha256" not in t for t in listed["tokens"])
    rows = await read_token_rows(store_url)
    assert [(r["id"], r["task"], r["sha256"], r["note"]) for r in rows] == [(made["id"], "c", token_sha256(token),
                                                                            "ci")]
    assert not any(token in str(value) for value in rows[0].values())  # the token itself is nowhere in the row
    async with live_broker(config, "", store_url=store_url) as live:  # a restart keeps it
        assert (await live.call("GET", f"/v1/actions/{record['id']}", headers=bearer(token)))[0] == 200
        code, revoked = await live.call("DELETE", f"/v1/admin/tokens/{made['id']}", headers=bearer(ADMIN))
        assert code == 200 and revoked["revoked_at"] is not None
        code, reply = await live.call("GET", f"/v1/actions/{record['id']}", headers=bearer(token))
        assert (code, reply["error"]["reason"]) == (401, "unknown or revoked token")
        assert (await live.call("DELETE", "/v1/admin/tokens/config:a:0", headers=bearer(ADMIN)))[0] == 409
        assert (await live.call("DELETE", "/v1/admin/tokens/tok_nope", headers=bearer(ADMIN)))[0] == 404
    async with live_broker(config, "", store_url=store_url) as live:  # and the revocation
        assert (await live.call("GET", f"/v1/actions/{record['id']}", headers=bearer(token)))[0] == 401


async def test_the_store_keeps_tokens_by_hash_and_revocations_once(store: Store):
    first, _ = mint("a", "")
    admin, _ = mint(None, "ops")
    await store.add_token(first)
    await store.add_token(admin)
    assert await store.load_tokens() == [first, admin]
    revoked = await store.revoke_token(first.id, 100.0)
    assert revoked is not None and revoked.revoked_at == 100.0
    again = await store.revoke_token(first.id, 200.0)
    assert again is not None and again.revoked_at == 100.0  # revoked when it first was
    assert await store.revoke_token("tok_nope", 1.0) is None
    with pytest.raises(IntegrityError):  # one hash, one owner
        await store.add_token(StoredToken(id="tok_other", sha256=first.sha256, task="b", note="", created_at=1.0))


@pytest.mark.slow
async def test_cli_tokens_reach_a_running_broker(tmp_path):
    path = tmp_path / "tangram.toml"
    write_config(path, str(tmp_path / "tangram.db"), "")
    made = cli("token", "create", "a", "--note", "from the cli", "--config", str(path))
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("tgm_") and "tok_" in made.stderr
    hashed = cli("token", "hash", stdin=token + "\n")
    assert hashed.stdout.strip() == token_sha256(token)
    async with broker_from_file(path) as live:
        code, record = await live.call("POST", "/v1/actions", json=lease(), headers=bearer(token))
        assert code == 201 and record["task"] == "a"
        token_id = next(t["id"] for t in (await live.call("GET", "/v1/admin/tokens", headers=bearer(ADMIN)))[1][
            "tokens"] if t["source"] == "store")
        revoked = cli("token", "revoke", token_id, "--config", str(path))
        assert revoked.returncode == 0, revoked.stderr
        code, reloaded = await live.call("POST", "/v1/admin/reload", headers=bearer(ADMIN))
        assert code == 200 and reloaded["config"] == str(path)
        assert (await live.call("GET", f"/v1/actions/{record['id']}", headers=bearer(token)))[0] == 401
    assert cli("token", "create", "--config", str(path)).returncode == 2  # neither a task nor --admin
    assert cli("token", "revoke", "tok_nope", "--config", str(path)).returncode == 1


async def test_reload_rereads_tokens_and_caps_from_the_file(tmp_path):
    path = tmp_path / "tangram.toml"
    write_config(path, str(tmp_path / "tangram.db"), f'[tasks.a]\ntoken_sha256 = "{token_sha256(TOKEN_A)}"\n')
    async with broker_from_file(path) as live:
        assert (await live.call("POST", "/v1/actions", json=lease(), headers=bearer(TOKEN_B)))[0] == 401
        write_config(path, str(tmp_path / "tangram.db"),
                     f'[tasks.a]\ntoken_sha256 = "{token_sha256(TOKEN_A)}"\nmax_queued = 0\n'
                     f'[tasks.b]\ntoken_sha256 = "{token_sha256(TOKEN_B)}"\n')
        code, reply = await live.call("POST", "/v1/admin/reload", headers=bearer(ADMIN))
        assert code == 200 and reply["reloaded"][:3] == ["auth", "tasks", "store tokens"] and reply["tokens"] == 3
        assert (await live.call("POST", "/v1/actions", json=lease(), headers=bearer(TOKEN_B)))[0] == 201
        code, reply = await live.call("POST", "/v1/actions", json=lease(), headers=bearer(TOKEN_A))
        assert (code, reply["error"]["cap"]) == (429, "max_queued")
        path.write_text(path.read_text() + "[tasks.c]\ntoken_sha256 = \"not a hash\"\n")
        code, reply = await live.call("POST", "/v1/admin/reload", headers=bearer(ADMIN))
        assert (code, reply["error"]["field"]) == (422, "config") and "tasks.c.token_sha256" in reply["error"]["reason"]
        assert (await live.call("POST", "/v1/actions", json=lease(), headers=bearer(TOKEN_B)))[0] == 201


async def test_auth_turns_on_by_itself_once_the_store_holds_a_token(db):
    async with live_broker({**LEASES, "auth": {"refresh_s": 0.05}}, db) as live:
        assert (await live.call("POST", "/v1/actions", json=lease(task="t")))[0] == 201
        row, token = mint("t", "")
        await live.broker.store.add_token(row)  # as `tangram token create` in another process would
        for _ in range(400):
            if (await live.call("POST", "/v1/actions", json=lease(task="t")))[0] == 401:
                break
            await asyncio.sleep(0.05)
        assert (await live.call("POST", "/v1/actions", json=lease(task="t")))[0] == 401
        assert (await live.call("POST", "/v1/actions", json=lease(), headers=bearer(token)))[0] == 201


# -- config ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,key", [
    ({"auth": {"admin_token_sha256": "tgm_plaintext"}}, "auth.admin_token_sha256"),
    ({"auth": {"required": "yes"}}, "auth.required"),
    ({"auth": {"refresh_s": 0}}, "auth.refresh_s"),
    ({"auth": {"colour": 1}}, "auth.colour"),
    ({"tasks": {"a": {"token_sha256": []}}}, "tasks.a.token_sha256"),
    ({"tasks": {"a": {"token_sha256": "ab" * 32}, "b": {"token_sha256": "AB" * 32}}}, "tasks.b.token_sha256"),
    ({"auth": {"admin_token_sha256": "ab" * 32}, "tasks": {"a": {"token_sha256": "ab" * 32}}},
     "tasks.a.token_sha256"),
    ({"tasks": {"max_running": -1}}, "tasks.max_running"),
    ({"tasks": {"max_runing": 1}}, "tasks.max_runing"),
    ({"tasks": {"a": {"max_queued": True}}}, "tasks.a.max_queued"),
    ({"tasks": {"bad name": {}}}, "tasks.bad name"),
    ({"server": {"access": {}}}, "server.access"),
])
def test_bad_auth_and_task_config_names_the_key(raw, key):
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert error.value.key == key, str(error.value)


async def test_a_task_token_sees_only_its_tasks_learned_profiles(db):
    async with live_broker(secured(), db) as live:
        for token in (TOKEN_A, TOKEN_A, TOKEN_B):
            code, _ = await live.call("POST", "/v1/actions?wait=true", json=lease(), headers=bearer(token))
            assert code == 200
        code, mine = await live.call("GET", "/v1/profiles", headers=bearer(TOKEN_A))
        assert code == 200 and [(p["task"], p["samples"]) for p in mine["profiles"]] == [("a", 2)]
        code, reply = await live.call("GET", "/v1/profiles?task=b", headers=bearer(TOKEN_A))
        assert (code, reply["error"]["field"]) == (403, "task")
        code, every = await live.call("GET", "/v1/profiles", headers=bearer(ADMIN))
        assert [(p["task"], p["samples"]) for p in every["profiles"]] == [("a", 2), ("b", 1)]  # most observed first
