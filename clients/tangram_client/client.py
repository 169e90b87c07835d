"""Async Python client of the broker's REST API (aiohttp).

Every submit carries an idempotency key (generated when the caller gives none), so a submit retried after a lost
connection or a 503 returns the same action instead of running it twice. Retries are bounded, back off
exponentially with jitter, and honour ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from tangram_client.errors import BrokerUnreachable, ConflictError, WaitTimeout, api_error
from tangram_client.output_stream import OutputPiece, read_pieces
from tangram_client.records import ActionRecord
from tangram_client.retry import backoff_s, retry_after_s
from tangram_client.trace_context import trace_headers

if TYPE_CHECKING:  # typing.Self is Python 3.11's; the client runs on 3.10
    from typing_extensions import Self

#: statuses worth retrying: the broker is overloaded (queue full, over a cap) and says so
RETRY_STATUSES = frozenset({429, 503})
#: where a client without a ``token`` argument finds its bearer token
TOKEN_ENV = "TANGRAM_TOKEN"
#: slack over a long poll's wait before the HTTP request itself counts as timed out
POLL_SLACK_S = 30.0
#: the longest pause between two brokers while failing over (a standby takes over within seconds)
FAILOVER_PAUSE_S = 1.0

Demand = int | tuple[int, int] | Sequence[int] | Mapping[str, Any]


def unit_demand(units: Demand) -> Any:
    """A demand in the broker's JSON: ``2`` -> 2, ``(1, 8)`` -> a range, ``[1, 2, 4]`` -> a discrete set."""
    if isinstance(units, bool):
        raise TypeError("a demand is a unit count, a (min, max) range or a list of choices, not a bool")
    if isinstance(units, (int, Mapping)):
        return units
    if isinstance(units, tuple) and len(units) == 2:
        return {"min": units[0], "max": units[1]}
    return {"choices": list(units)}


def _standby_error(payload: Any) -> dict[str, Any] | None:
    """The error of a broker standing by (its body names the leader), else None."""
    error = payload.get("error") if isinstance(payload, dict) else None
    return error if isinstance(error, dict) and error.get("code") == "standby" else None


class AsyncTangramClient:
    """A session with a broker. Use as ``async with AsyncTangramClient(url, task="my-task") as client``."""

    def __init__(self, base_url: str | Sequence[str] = "http://127.0.0.1:8300", *, task: str | None = None,
                 retries: int = 3, backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 request_timeout_s: float = 30.0, wait_chunk_s: float = 30.0, max_connections: int = 100,
                 token: str | None = None, failover_s: float = 30.0) -> None:
        """``base_url`` may list the brokers of one store (a leader and its standbys): a request that finds a
        broker unreachable, or standing by, goes to the next one (or to the leader the standby names) for up to
        ``failover_s``; submits carry idempotency keys, so none runs twice. ``wait_chunk_s`` is one long poll's
        length; longer waits take several. It must not exceed the broker's ``server.max_wait_s`` (300 s by
        default). ``token``: the bearer token of a broker with auth; without one, ``$TANGRAM_TOKEN`` if set."""
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.urls = [url.rstrip("/") for url in ([base_url] if isinstance(base_url, str) else base_url)]
        if not self.urls:
            raise ValueError("base_url: give at least one broker URL")
        self.base_url = self.urls[0]
        self.failover_s = failover_s
        self.task = task
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.request_timeout_s = request_timeout_s
        self.wait_chunk_s = wait_chunk_s
        self.max_connections = max_connections
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        """The session, made on first use so that it belongs to the loop the caller runs in."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections), headers=self.headers,
                json_serialize=lambda value: orjson.dumps(value).decode())
        return self._session

    # -- transport ------------------------------------------------------------------------------------------

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        asked = retry_after_s(retry_after)
        if asked is not None:
            return min(asked, self.max_backoff_s)
        return backoff_s(attempt, self.backoff_s, self.max_backoff_s)

    async def _request(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None,
                       timeout_s: float | None = None, raw_answer: bool = False) -> tuple[int, Any]:
        """One API call with bounded retries on connection errors and 429/503; returns (status, JSON body, or the
        body's bytes with ``raw_answer``) or raises the typed error of the broker's answer."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s)
        headers = trace_headers()
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                async with self._http().request(method, self.base_url + path, json=body, params=params,
                                                headers=headers, timeout=timeout) as response:
                    raw = await response.read()
                    status, retry_after = response.status, response.headers.get("Retry-After")
            except (aiohttp.ClientConnectionError, TimeoutError) as error:
                if self._fail_over(started, None):
                    await asyncio.sleep(min(self._delay(attempt, None), FAILOVER_PAUSE_S))
                    attempt += 1
                    continue
                if attempt >= self.retries:
                    raise BrokerUnreachable(f"{method} {path}: {error!r} after {attempt + 1} attempts") from error
                await asyncio.sleep(self._delay(attempt, None))
                attempt += 1
                continue
            if raw_answer and status < 400:
                return status, raw
            try:
                payload = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                payload = raw.decode(errors="replace")
            if status < 400:
                return status, payload
            standby = _standby_error(payload) if status == 503 else None
            if standby is not None and self._fail_over(started, standby.get("leader")):
                await asyncio.sleep(min(self._delay(attempt, None), FAILOVER_PAUSE_S))
                attempt += 1
                continue
            if status in RETRY_STATUSES and attempt < self.retries:
                await asyncio.sleep(self._delay(attempt, retry_after))
                attempt += 1
                continue
            raise api_error(status, payload, attempt + 1)

    def _fail_over(self, started: float, leader: str | None) -> bool:
        """Move to the named leader if it is one of ours, else to the next broker; False when there is no other
        broker or the request has tried for ``failover_s`` already."""
        if len(self.urls) < 2 or time.monotonic() - started > self.failover_s:
            return False
        leader = leader.rstrip("/") if leader else None
        if leader in self.urls and leader != self.base_url:
            self.base_url = leader
        else:
            self.base_url = self.urls[(self.urls.index(self.base_url) + 1) % len(self.urls)]
        return True

    def _task(self, task: str | None) -> str:
        task = task or self.task
        if not task:
            raise ValueError("no task: pass task= here or to the client")
        return task

    # -- actions --------------------------------------------------------------------------------------------

    def action_body(self, kind: str, demand: Mapping[str, Demand], spec: Mapping[str, Any] | None = None, *,
                    task: str | None = None, trajectory: str | None = None,
                    elasticity: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                    idempotency_key: str | None = None, signature: str | None = None) -> dict[str, Any]:
        """The JSON of one action, with an idempotency key generated when none is given."""
        body: dict[str, Any] = {"task": self._task(task), "kind": kind,
                                "demand": {name: unit_demand(units) for name, units in demand.items()},
                                "spec": dict(spec or {}), "idempotency_key": idempotency_key or uuid.uuid4().hex}
        optional = {"trajectory": trajectory, "elasticity": elasticity, "timeout_s": timeout_s,
                    "signature": signature}
        body.update({key: value for key, value in optional.items() if value is not None})
        return body

    async def submit(self, kind: str, demand: Mapping[str, Demand], spec: Mapping[str, Any] | None = None, *,
                     task: str | None = None, trajectory: str | None = None,
                     elasticity: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                     idempotency_key: str | None = None, signature: str | None = None,
                     wait: bool = False) -> ActionRecord:
        """Queue one action; with ``wait=True`` return only once it has ended (in any state)."""
        body = self.action_body(kind, demand, spec, task=task, trajectory=trajectory, elasticity=elasticity,
                                timeout_s=timeout_s, idempotency_key=idempotency_key, signature=signature)
        if not wait:
            _, payload = await self._request("POST", "/v1/actions", body=body)
            return ActionRecord.from_json(payload)
        _, payload = await self._request("POST", "/v1/actions", body=body, params=self._wait_params(self.wait_chunk_s),
                                         timeout_s=self.wait_chunk_s + POLL_SLACK_S)
        record = ActionRecord.from_json(payload)
        return record if record.terminal else await self.wait(record.id)

    async def submit_batch(self, actions: Sequence[Mapping[str, Any]]) -> list[ActionRecord]:
        """Queue several actions in one request. Each item takes ``submit``'s arguments as keys (``kind``,
        ``demand``, ``spec``, ``trajectory``, ...); the client's task and fresh idempotency keys fill the gaps."""
        bodies = [self.action_body(**dict(item)) for item in actions]
        _, payload = await self._request("POST", "/v1/actions:batch", body={"actions": bodies})
        return [ActionRecord.from_json(item) for item in payload["actions"]]

    @staticmethod
    def _wait_params(seconds: float) -> dict[str, str]:
        return {"wait": "true", "wait_timeout_s": f"{seconds:.3f}"}

    async def get(self, action_id: str) -> ActionRecord:
        _, payload = await self._request("GET", f"/v1/actions/{action_id}")
        return ActionRecord.from_json(payload)

    async def wait(self, action_id: str, timeout_s: float | None = None) -> ActionRecord:
        """The action's record once it has ended; ``WaitTimeout`` if ``timeout_s`` passes first. Without a
        timeout this waits as long as the action's own deadline allows."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            chunk = self.wait_chunk_s
            if deadline is not None:
                chunk = max(0.0, min(chunk, deadline - time.monotonic()))
            _, payload = await self._request("GET", f"/v1/actions/{action_id}", params=self._wait_params(chunk),
                                             timeout_s=chunk + POLL_SLACK_S)
            record = ActionRecord.from_json(payload)
            if record.terminal:
                return record
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(record)

    async def run(self, kind: str, demand: Mapping[str, Demand], spec: Mapping[str, Any] | None = None,
                  **options: Any) -> ActionRecord:
        """Submit, wait, and return the record of a succeeded action; ``ActionError`` for any other end."""
        record = await self.submit(kind, demand, spec, wait=True, **options)
        return record.raise_for_state()

    async def output(self, action_id: str) -> AsyncGenerator[OutputPiece]:
        """An ``exec`` action's stdout and stderr as they come, then its ``end`` (``GET /v1/actions/{id}/output``):
        a queued action's waits for it to start; an ended one's is its record's kept output. Not retried: a
        stream opened again starts over from the first byte. Leaving the loop early does not cancel the action."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.request_timeout_s)
        async with self._http().get(f"{self.base_url}/v1/actions/{action_id}/output", timeout=timeout) as response:
            if response.status >= 400:
                raw = await response.read()
                try:
                    payload = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    payload = raw.decode(errors="replace")
                raise api_error(response.status, payload)
            async for piece in read_pieces(response.content.iter_any()):
                yield piece

    async def cancel(self, action_id: str) -> ActionRecord:
        """Cancel a queued or running action. A 409 (it had already ended) is raised as ``ConflictError``."""
        _, payload = await self._request("DELETE", f"/v1/actions/{action_id}")
        return ActionRecord.from_json(payload)

    async def exec(self, command: str | Sequence[str], *, cores: Demand = 1, trajectory: str | None = None,
                   task: str | None = None, elasticity: Mapping[str, Any] | None = None,
                   timeout_s: float | None = None, idempotency_key: str | None = None,
                   signature: str | None = None, **spec: Any) -> ActionRecord:
        """Run a shell command (a string) or an argv list in the trajectory's sandbox and return the succeeded
        record: ``result`` has ``exit_code``, ``stdout``, ``stderr``, ``environment``. A non-zero exit code is a
        succeeded action; timeouts, lost sandboxes and memory kills raise ``ActionError``. Other keyword
        arguments are spec fields (``files``, ``env``, ``cwd``, ``memory_mb``, ``image``, ``pytest_parallel``,
        ``output_limit``, ``environment``, ``sandbox_user``; ``run_timeout_s`` bounds the command's own run while
        ``timeout_s`` is the deadline from submission, queueing included; ``stdin`` is text or ``{"base64": ...}``;
        ``user`` a uid, ``"UID:GID"`` or a user name of the image; ``background=True`` answers at once with
        ``result["pid"]``). A timed-out action's error says which limit fired in ``error["limit"]``."""
        command = command if isinstance(command, str) else list(command)
        return await self.run("exec", {"cpu": cores}, {"command": command, **spec}, task=task,
                              trajectory=trajectory, elasticity=elasticity, timeout_s=timeout_s,
                              idempotency_key=idempotency_key, signature=signature)

    # -- leases ---------------------------------------------------------------------------------------------

    async def lease(self, demand: Mapping[str, Demand], *, ttl_s: float, task: str | None = None,
                    timeout_s: float | None = None, idempotency_key: str | None = None) -> ActionRecord:
        """Wait until the units are granted; they are held until ``release_lease`` or the TTL."""
        return await self.run("lease", demand, {"ttl_s": ttl_s}, task=task, timeout_s=timeout_s,
                              idempotency_key=idempotency_key)

    async def release_lease(self, lease_id: str) -> ActionRecord:
        """Give a lease's units back. Idempotent across retries: a lease found already returned is not an error
        when this call's own earlier attempt may have returned it."""
        try:
            _, payload = await self._request("DELETE", f"/v1/leases/{lease_id}")
        except ConflictError as error:
            if error.attempts == 1:
                raise
            return await self.get(lease_id)
        return ActionRecord.from_json(payload)

    @asynccontextmanager
    async def leased(self, demand: Mapping[str, Demand], *, ttl_s: float,
                     task: str | None = None) -> AsyncIterator[ActionRecord]:
        """Hold a lease for the body of an ``async with``; the units go back however the body ends."""
        lease = await self.lease(demand, ttl_s=ttl_s, task=task)
        try:
            yield lease
        finally:
            await self.release_lease(lease.id)

    # -- environments ---------------------------------------------------------------------------------------

    async def create_environment(self, *, task: str | None = None, trajectory: str | None = None,
                                 image: str | None = None, memory_mb: int | None = None,
                                 files: Mapping[str, Any] | None = None,
                                 network: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Make a sandbox now (instead of on a trajectory's first exec); ``exec(..., environment=id)`` uses it.
        ``network``: ``{"mode": "proxy", "allow": ["host", ...]}`` for an HTTP(S) proxy to those hosts."""
        body: dict[str, Any] = {"task": self._task(task)}
        optional = {"trajectory": trajectory, "image": image, "memory_mb": memory_mb, "files": files,
                    "network": network}
        body.update({key: value for key, value in optional.items() if value is not None})
        _, payload = await self._request("POST", "/v1/environments", body=body)
        return payload

    async def environments(self, *, task: str | None = None) -> list[dict[str, Any]]:
        """The environments of a task (the client's by default)."""
        _, payload = await self._request("GET", "/v1/environments", params={"task": self._task(task)})
        return payload["environments"]

    async def get_environment(self, environment_id: str) -> dict[str, Any]:
        _, payload = await self._request("GET", f"/v1/environments/{environment_id}")
        return payload

    async def delete_environment(self, environment_id: str) -> dict[str, Any]:
        _, payload = await self._request("DELETE", f"/v1/environments/{environment_id}")
        return payload

    async def fork(self, environment_id: str, n: int | None = None, *,
                   trajectories: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """``n`` new environments from an environment's files as they are once its running commands end (GRPO's
        rollouts from one prepared state), each its own trajectory: ``trajectories`` (one per fork; ``n`` may be
        left out), else ``<source trajectory or id>-fork-<i>``. Naming them makes a retried fork a 409, never a
        second set. Answers the forks' records."""
        params = {"n": str(n)} if n is not None else None
        body = {"trajectories": list(trajectories)} if trajectories is not None else None
        _, payload = await self._request("POST", f"/v1/environments/{environment_id}/fork", body=body, params=params)
        return payload["environments"]

    async def write_files(self, environment_id: str, files: Mapping[str, str | bytes]) -> dict[str, Any]:
        """Write files (relative path -> text, or bytes) into an environment at any time: after the commands
        running there end, before those submitted after. Answers ``{"environment", "files", "bytes"}``."""
        body = {"files": {path: content if isinstance(content, str) else
                          {"base64": base64.b64encode(content).decode()} for path, content in files.items()}}
        _, payload = await self._request("PUT", f"/v1/environments/{environment_id}/files", body=body)
        return payload

    async def read_file(self, environment_id: str, path: str) -> bytes:
        """A file's bytes from an environment's working directory, or an uncompressed tar for a directory."""
        _, data = await self._request("GET", f"/v1/environments/{environment_id}/files", params={"path": path},
                                      raw_answer=True)
        return bytes(data)

    # -- broker ---------------------------------------------------------------------------------------------

    async def resources(self) -> dict[str, Any]:
        """Every resource's capacity, use and queue, and recent ACT percentiles."""
        _, payload = await self._request("GET", "/v1/resources")
        return payload

    async def health(self) -> dict[str, Any]:
        _, payload = await self._request("GET", "/healthz")
        return payload

