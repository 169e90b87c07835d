"""Blocking twin of ``AsyncTangramClient`` for scripts and thread-based rollout loops.

It runs one async client on a private event loop in a daemon thread, so both share one implementation (retries,
idempotency, typed errors) and calls from several threads share one connection pool.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from tangram_client.client import AsyncTangramClient, Demand
from tangram_client.output_stream import OutputPiece
from tangram_client.records import ActionRecord

if TYPE_CHECKING:  # typing.Self is Python 3.11's; the client runs on 3.10
    from typing_extensions import Self

T = TypeVar("T")


async def _next(items: AsyncIterator[T]) -> T:
    """``anext`` as a coroutine, which the client's loop thread takes."""
    return await anext(items)


class TangramClient:
    """``with TangramClient(url, task="my-task") as client: client.exec("ls", trajectory="t1")``. Arguments and
    methods are those of ``AsyncTangramClient``; each method blocks until its answer."""

    def __init__(self, base_url: str | Sequence[str] = "http://127.0.0.1:8300", **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tangram-client", daemon=True)
        self._thread.start()
        self._client = AsyncTangramClient(base_url, **options)

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def task(self) -> str | None:
        return self._client.task

    def submit(self, kind: str, demand: Mapping[str, Demand], spec: Mapping[str, Any] | None = None,
               **options: Any) -> ActionRecord:
        return self._call(self._client.submit(kind, demand, spec, **options))

    def submit_batch(self, actions: Sequence[Mapping[str, Any]]) -> list[ActionRecord]:
        return self._call(self._client.submit_batch(actions))

    def get(self, action_id: str) -> ActionRecord:
        return self._call(self._client.get(action_id))

    def wait(self, action_id: str, timeout_s: float | None = None) -> ActionRecord:
        return self._call(self._client.wait(action_id, timeout_s))

    def run(self, kind: str, demand: Mapping[str, Demand], spec: Mapping[str, Any] | None = None,
            **options: Any) -> ActionRecord:
        return self._call(self._client.run(kind, demand, spec, **options))

    def cancel(self, action_id: str) -> ActionRecord:
        return self._call(self._client.cancel(action_id))

    def exec(self, command: str | Sequence[str], **options: Any) -> ActionRecord:
        return self._call(self._client.exec(command, **options))

    def lease(self, demand: Mapping[str, Demand], *, ttl_s: float, **options: Any) -> ActionRecord:
        return self._call(self._client.lease(demand, ttl_s=ttl_s, **options))

    def release_lease(self, lease_id: str) -> ActionRecord:
        return self._call(self._client.release_lease(lease_id))

    @contextmanager
    def leased(self, demand: Mapping[str, Demand], *, ttl_s: float, task: str | None = None) -> Iterator[ActionRecord]:
        lease = self.lease(demand, ttl_s=ttl_s, task=task)
        try:
            yield lease
        finally:
            self.release_lease(lease.id)

    def create_environment(self, **options: Any) -> dict[str, Any]:
        return self._call(self._client.create_environment(**options))

    def environments(self, *, task: str | None = None) -> list[dict[str, Any]]:
        return self._call(self._client.environments(task=task))

    def get_environment(self, environment_id: str) -> dict[str, Any]:
        return self._call(self._client.get_environment(environment_id))

    def delete_environment(self, environment_id: str) -> dict[str, Any]:
        return self._call(self._client.delete_environment(environment_id))

    def fork(self, environment_id: str, n: int | None = None, *,
             trajectories: Sequence[str] | None = None) -> list[dict[str, Any]]:
        return self._call(self._client.fork(environment_id, n, trajectories=trajectories))

    def write_files(self, environment_id: str, files: Mapping[str, str | bytes]) -> dict[str, Any]:
        return self._call(self._client.write_files(environment_id, files))

    def read_file(self, environment_id: str, path: str) -> bytes:
        return self._call(self._client.read_file(environment_id, path))

    def output(self, action_id: str) -> Iterator[OutputPiece]:
        """Each piece as it comes; leaving the loop early closes the stream (the action runs on)."""
        pieces = self._client.output(action_id)
        try:
            while True:
                try:
                    yield self._call(_next(pieces))
                except StopAsyncIteration:
                    return
        finally:
            self._call(pieces.aclose())

    def resources(self) -> dict[str, Any]:
        return self._call(self._client.resources())

    def health(self) -> dict[str, Any]:
        return self._call(self._client.health())
