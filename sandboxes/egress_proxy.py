"""A sandbox's egress proxy, on its node: an HTTP(S) proxy on a unix socket that only that sandbox can reach (its
relay, ``sandboxes/egress_relay.py``, carries the connections of its commands there), letting through what its
environment's allow-list and the node's address rules permit (``sandboxes/egress_policy.py``).

One request per connection. ``CONNECT host:port`` opens a tunnel (HTTPS: the bytes pass untouched); a request with
an absolute ``http://`` URI is sent on to its origin in origin form with ``Connection: close``, and the bytes then
flow both ways until either side closes. Anything else is refused with a status and a reason in the body, and
logged: a malformed or oversize head (400, 431), another form (400, 405), a destination outside the allow-list or
whose every address the rules refuse (403). The head must arrive within ``HEAD_TIMEOUT_S``; a sandbox holds at most
``MAX_CONNECTIONS`` at once. Names are resolved here, and the connection goes to the address that was checked (a
name cannot resolve once for the check and again for the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from sandboxes.egress_policy import AddressRules, AllowList, NodeView, split_authority

log = logging.getLogger("tangram.sandboxes.egress")

#: the largest request head (request line and headers) read; a larger one is refused with 431
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADERS = 100
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
#: connections one sandbox may hold open through its proxy; more are refused with 503
MAX_CONNECTIONS = 64
CHUNK_BYTES = 64 * 1024
_METHOD = re.compile(r"^[A-Z]{1,20}\Z")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
#: request headers meant for the proxy or this hop only: not sent on (``Connection: close`` replaces them)
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "upgrade"})


class Refused(Exception):
    """A request the proxy does not serve: the status and reason it answers."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_STATUS_TEXT = {400: "Bad Request", 403: "Forbidden", 405: "Method Not Allowed", 408: "Request Timeout",
                431: "Request Header Fields Too Large", 502: "Bad Gateway", 503: "Service Unavailable",
                504: "Gateway Timeout"}


@dataclass(frozen=True)
class ProxyRequest:
    """A parsed request head: where it goes, and (plain HTTP) the head to send there; None for a tunnel."""

    method: str
    host: str
    port: int
    forward: bytes | None


def parse_head(head: bytes) -> ProxyRequest:
    """The request in ``head`` (ending in an empty line). Raises ``Refused``."""
    lines = head.decode("latin-1").split("\r\n")
    if lines[-2:] != ["", ""]:
        raise Refused(400, "the request head must end with an empty line (CRLF line ends)")
    lines = lines[:-2]
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _METHOD.match(parts[0]) or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise Refused(400, "the request line must be METHOD TARGET HTTP/1.x")
    method, target, version = parts
    headers = lines[1:]
    if len(headers) > MAX_HEADERS:
        raise Refused(431, f"more than {MAX_HEADERS} header lines")
    names = []
    for line in headers:
        name, colon, _ = line.partition(":")
        if not colon or not _HEADER_NAME.match(name):
            raise Refused(400, "a header line must be NAME: VALUE")
        names.append(name.lower())
    try:
        if method == "CONNECT":
            host, port = split_authority(target)
            if port is None:
                raise Refused(400, "CONNECT takes host:port")
            return ProxyRequest(method, host, port, None)
        if not target.lower().startswith("http://"):
            if target.lower().startswith("https://"):
                raise Refused(405, "an https:// URL goes through CONNECT (set HTTPS_PROXY), not as a plain request")
            raise Refused(400, "a proxied request names an absolute http:// URL, or is a CONNECT")
        url = urlsplit(target)
        if url.username is not None or url.password is not None or not url.netloc:
            raise Refused(400, "the URL must name a host, without user or password")
        host, port = split_authority(url.netloc)
    except ValueError as error:
        raise Refused(400, f"the destination {error}") from None
    path = url.path or "/"
    kept = [line for line, name in zip(headers, names, strict=True) if name not in _HOP_HEADERS]
    first = f"{method} {path}{'?' + url.query if url.query else ''} {version}"
    forward = "\r\n".join([first, *kept, "Connection: close", "", ""]).encode("latin-1")
    return ProxyRequest(method, host, port or 80, forward)


class EgressProxy:
    """One sandbox's proxy, serving on its own unix socket with its environment's allow-list."""

    def __init__(self, env_id: str, allow: AllowList, rules: AddressRules) -> None:
        self.env_id = env_id
        self.allow = allow
        self.rules = rules
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        #: both ends of every open connection, for ``close`` to cut (a handler cancelled instead would be logged
        #: as an error by asyncio's stream server)
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, path: str) -> None:
        """Listen on ``path`` (in a directory the sandbox sees read-only), connectable by the sandbox's user."""
        self._server = await asyncio.start_unix_server(self._accept, path, limit=MAX_HEAD_BYTES)
        os.chmod(path, 0o666)

    async def close(self) -> None:
        """Stop listening and cut every connection still open."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._writers:
            writer.transport.abort()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            if len(self._connections) >= MAX_CONNECTIONS:
                raise Refused(503, f"more than {MAX_CONNECTIONS} connections open through this sandbox's proxy")
            self._connections.add(task)
            self._writers.add(writer)
            await self._serve(reader, writer)
        except Refused as refused:
            log.warning("egress of %s refused (%d): %s", self.env_id, refused.status, refused.reason)
            await _answer(writer, refused)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(task)
            self._writers.discard(writer)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            raise Refused(431, f"the request head is over {MAX_HEAD_BYTES} bytes") from None
        except TimeoutError:
            raise Refused(408, f"no complete request head within {HEAD_TIMEOUT_S:.0f} s") from None
        request = parse_head(head)
        where = f"{request.host}:{request.port}"
        if not self.allow.permits(request.host, request.port):
            raise Refused(403, f"{where} is not in this environment's network.allow")
        upstream_reader, upstream = await self._open(request.host, request.port)
        log.info("egress of %s: %s %s", self.env_id, request.method, where)
        self._writers.add(upstream)
        try:
            if request.forward is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.write(request.forward)
            await asyncio.gather(_pipe(reader, upstream), _pipe(upstream_reader, writer))
        finally:
            self._writers.discard(upstream)
            upstream.close()

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the first of ``host``'s addresses the rules permit that accepts one. Raises
        ``Refused``."""
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as error:
            raise Refused(502, f"{host} does not resolve: {error}") from None
        node = await asyncio.to_thread(NodeView.read)
        reasons, failed = [], None
        for _family, _type, _proto, _name, address in infos:
            ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
            reason = self.rules.refusal(ip, port, node)
            if reason is not None:
                reasons.append(reason)
                continue
            try:
                return await asyncio.wait_for(asyncio.open_connection(str(ip), port), CONNECT_TIMEOUT_S)
            except TimeoutError:
                failed = Refused(504, f"{host}:{port} did not accept within {CONNECT_TIMEOUT_S:.0f} s")
            except OSError as error:
                failed = Refused(502, f"{host}:{port} refused the connection: {error.strerror or error}")
        if failed is not None:
            raise failed
        raise Refused(403, f"{host}:{port} resolves only to refused addresses: {'; '.join(dict.fromkeys(reasons))}")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until ``reader`` ends, then end ``writer``'s side (the other direction may go on)."""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _answer(writer: asyncio.StreamWriter, refused: Refused) -> None:
    body = f"{refused.reason}\n".encode()
    head = (f"HTTP/1.1 {refused.status} {_STATUS_TEXT.get(refused.status, 'Refused')}\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    with contextlib.suppress(ConnectionError):
        writer.write(head.encode() + body)
        await writer.drain()
