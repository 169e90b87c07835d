"""Host-side async client for the in-sandbox command executor (sandboxes/executor.py).

Why: `docker exec` costs ~40 ms per call (API round trip, exec-instance creation, attach), which dominates short
tool actions on the broker's hot path. The executor runs inside the sandbox and takes commands over a unix
socket (bind-mounted to the host for containers), so a round trip for `true` is ~1 ms plus process spawn.

Protocol: each message is a 4-byte big-endian length followed by UTF-8 JSON, then, when the JSON's "payload"
counts them, that many raw bytes (a file op's: a write's files, a read's file; a streamed run's output frames,
which come before its answer). One request per connection here;
closing the connection while a command runs makes the executor kill the command's process tree, which is how
a broker deadline or a client cancel reaches the sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from sandboxes.executor import DEFAULT_OUTPUT_LIMIT
from sandboxes.executor_answer import BadAnswer, frame_limit, payload_limit
from sandboxes.untrusted_paths import UntrustedPath, open_socket, via_descriptor

__all__ = ["EXECUTOR_PATH", "ExecutorUnavailable", "OutputSink", "call", "encode_once", "ping", "wait_ready"]

#: ``sink(stream, data)``: a piece of a running command's output ("stdout" or "stderr"), as the executor read it
OutputSink = Callable[[str, bytes], None]

EXECUTOR_PATH: str = str(Path(__file__).resolve().with_name("executor.py"))
"""Absolute path of executor.py, for backends that copy it into containers."""

_HEADER = struct.Struct(">I")


class ExecutorUnavailable(Exception):
    """The executor cannot be reached or dropped the connection before a full response.

    Typical causes: the sandbox is not up yet, or it died (container killed, executor OOM-killed). The broker
    treats this as a sandbox failure, not as a command result.
    """

    def __init__(self, socket_path: str, reason: str, *, final: bool = False) -> None:
        """``final``: what is at the socket's path will not become the executor by waiting (not a socket)."""
        super().__init__(f"executor at {socket_path} unavailable: {reason}")
        self.socket_path = socket_path
        self.reason = reason
        self.final = final


async def _connect(socket_path: str, timeout: float) -> socket.socket:
    """A connected non-blocking unix socket.

    The socket's directory is the sandbox's to write, so the path's last component is opened without following a
    link and must be a socket (``sandboxes/untrusted_paths.py``); the connection goes to that inode.

    Not asyncio.open_unix_connection(path): on Linux a non-blocking AF_UNIX connect() fails with EAGAIN while
    the listener's backlog is full, and asyncio treats that like TCP's EINPROGRESS, handing back a socket that
    never connected (the first write then fails with "Connection lost"). Here EAGAIN is retried until timeout.
    """
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            target = open_socket(socket_path)
        except OSError as exc:
            raise ExecutorUnavailable(socket_path, f"connect failed: {exc}") from None
        except UntrustedPath as exc:
            raise ExecutorUnavailable(socket_path, f"connect refused: {exc}", final=True) from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(via_descriptor(target))
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise ExecutorUnavailable(socket_path, f"connect timed out after {timeout} s "
                                                       "(listen backlog full)") from None
        except OSError as exc:
            sock.close()
            raise ExecutorUnavailable(socket_path, f"connect failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        finally:
            os.close(target)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def _frame(request: dict[str, Any]) -> tuple[bytes, bytes]:
    """The request's frame and the raw bytes after it: its "payload" (bytes), counted in the frame's JSON."""
    payload = request.get("payload", b"")
    body = orjson.dumps({**request, "payload": len(payload)} if "payload" in request else request)
    return _HEADER.pack(len(body)) + body, payload


async def _read_payload(reader: asyncio.StreamReader, request: dict[str, Any], response: Any, socket_path: str) \
        -> None:
    """The raw bytes after an answer whose JSON counts them in "payload", in place of the count; refused unread
    when more than an honest executor sends for the request."""
    if not isinstance(response, dict) or "payload" not in response:
        return
    length, limit = response["payload"], payload_limit(request)
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= limit:
        raise BadAnswer(f"the executor at {socket_path} announced a payload of {length!r} bytes; an executor sends "
                        f"at most {limit} for this request")
    response["payload"] = await reader.readexactly(length)


async def _read_frame(reader: asyncio.StreamReader, request: dict[str, Any], socket_path: str) -> Any:
    """One answer frame's JSON, refused unread when larger than an honest executor sends for the request."""
    (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    limit = frame_limit(request)
    if length > limit:
        raise BadAnswer(f"the executor at {socket_path} answered with a frame of {length} bytes, more than an "
                        f"executor sends for this request ({limit})")
    body = await reader.readexactly(length)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ExecutorUnavailable(socket_path, f"malformed response: {exc}") from exc


async def _read_output(reader: asyncio.StreamReader, frame: dict[str, Any], left: dict[str, int], sink: OutputSink,
                       socket_path: str) -> None:
    """A streamed run's output frame (``"stream": true``): its raw bytes, handed to ``sink``. ``left`` counts what
    each stream may still send: never more than the request's ``output_limit`` in all, whatever the executor says."""
    stream, length = frame.get("stream"), frame.get("payload")
    if stream not in left or not isinstance(length, int) or isinstance(length, bool) \
            or not 0 <= length <= left[stream]:
        raise BadAnswer(f"the executor at {socket_path} streamed {length!r} bytes of {stream!r}; an executor streams "
                        f"stdout and stderr, each at most the request's output_limit in all")
    left[stream] -= length
    sink(stream, bytes(await reader.readexactly(length)))


async def call(socket_path: str, request: dict[str, Any], *, connect_timeout: float = 5.0,
               on_output: OutputSink | None = None) -> dict[str, Any]:
    """Send one request and return the executor's response.

    A request's "payload" (bytes) goes raw after its frame, and an answer's comes back as bytes in its "payload".
    Errors the executor reports about the command (bad field, missing cwd, ...) come back in the response's
    "error"; ExecutorUnavailable means the executor itself could not answer; BadAnswer, that it announced a frame
    or payload larger than the request allows (``sandboxes/executor_answer.py``), which is not read. If the
    awaiting task is cancelled, the connection is aborted at once so the executor kills the running command, and
    CancelledError propagates.

    ``on_output`` (a run only): the request asks for its output as it comes ("stream"), each piece handed to it
    before the response returns; an executor older than streaming sends none, and the output comes with the
    response only.
    """
    if on_output is not None:
        request = {**request, "stream": True}
    output_limit = request.get("output_limit", DEFAULT_OUTPUT_LIMIT)
    left = {name: output_limit if isinstance(output_limit, int) else 0 for name in ("stdout", "stderr")}
    sock = await _connect(socket_path, connect_timeout)
    try:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise
    try:
        frame, payload = _frame(request)
        writer.write(frame)
        if payload:
            writer.write(payload)
        await writer.drain()
        response = await _read_frame(reader, request, socket_path)
        while on_output is not None and isinstance(response, dict) and "stream" in response:
            await _read_output(reader, response, left, on_output, socket_path)
            response = await _read_frame(reader, request, socket_path)
        await _read_payload(reader, request, response, socket_path)
    except asyncio.IncompleteReadError as exc:
        writer.transport.abort()
        raise ExecutorUnavailable(socket_path, f"connection closed before a full response "
                                               f"({len(exc.partial)} of {exc.expected} bytes)") from None
    except OSError as exc:
        writer.transport.abort()
        raise ExecutorUnavailable(socket_path, f"connection failed: {exc}") from exc
    except BaseException:  # CancelledError above all: abort so the executor sees EOF and kills the command
        writer.transport.abort()
        raise
    writer.close()
    if not isinstance(response, dict):
        raise ExecutorUnavailable(socket_path, f"malformed response: {type(response).__name__}, not an object")
    return response


async def ping(socket_path: str, timeout: float = 2.0) -> dict[str, Any]:
    """{"ok": true, "pid": ..., "python": ...} from the executor, or ExecutorUnavailable within `timeout`."""
    try:
        async with asyncio.timeout(timeout):
            return await call(socket_path, {"op": "ping"}, connect_timeout=timeout)
    except TimeoutError:
        raise ExecutorUnavailable(socket_path, f"no ping answer within {timeout} s") from None
    except BadAnswer as error:
        raise ExecutorUnavailable(socket_path, str(error), final=True) from None


async def wait_ready(socket_path: str, timeout: float) -> dict[str, Any]:
    """Ping until the executor answers (a sandbox that is starting up), or raise ExecutorUnavailable."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    reason = "not tried"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExecutorUnavailable(socket_path, f"not ready after {timeout} s: {reason}")
        try:
            return await ping(socket_path, timeout=min(left, 2.0))
        except ExecutorUnavailable as exc:
            if exc.final:
                raise
            reason = exc.reason
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.1)


def encode_once(request: dict[str, Any]) -> str:
    """The argument for `python3 executor.py once ARG` (used through `docker exec` for remote engines); a "payload"
    (bytes) goes base64 in its JSON, an argument having no room for raw bytes.

    Linux caps one argv string at 128 KiB (MAX_ARG_STRLEN), so very large requests do not fit this path.
    """
    if "payload" in request:
        request = {**request, "payload": base64.b64encode(request["payload"]).decode("ascii")}
    return base64.urlsafe_b64encode(orjson.dumps(request)).decode("ascii")
