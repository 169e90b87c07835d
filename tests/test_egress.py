"""The egress proxy and its policy without Docker: allow-list matching, address rules after resolution, request
parsing (malformed or oversize heads refused, never a hang), and the proxy and relay on real sockets of this host's
loopback."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from pathlib import Path

import pytest

from managers.cpu.config import parse_cpu_config
from managers.cpu.exec_spec import ExecLimits, parse_exec_spec
from sandboxes import egress_relay
from sandboxes.egress_policy import MAX_RULES, AddressRules, AllowList, BadRule, HostRule, NodeView
from sandboxes.egress_proxy import MAX_HEAD_BYTES, EgressProxy, Refused, parse_head
from tangram.core.errors import ConfigError, Unprocessable
from tests.egress_servers import server

LOOPBACK_RULES = AddressRules(allow_loopback=True)
NODE = NodeView(frozenset({ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.1.2.3")}),
                frozenset({8000}))


@pytest.mark.parametrize(("rule", "host", "port", "admitted"), [
    ("example.com", "example.com", 443, True),
    ("Example.COM.", "example.com", 80, True),
    ("example.com", "a.example.com", 443, False),
    ("example.com:443", "example.com", 80, False),
    ("*.example.com", "a.b.example.com", 1, True),
    ("*.example.com", "example.com", 443, False),
    ("*.example.com", "badexample.com", 443, False),
    ("*.example.com:443", "a.example.com", 443, True),
    ("127.0.0.1:8080", "127.0.0.1", 8080, True),
    ("[::1]:80", "::1", 80, True),
    ("[0:0::1]", "::1", 9, True),
])
def test_allow_list_matching(rule: str, host: str, port: int, admitted: bool) -> None:
    assert AllowList.parse([rule]).permits(host, port) is admitted


@pytest.mark.parametrize("entry", ["", "a b", "*.", "*.127.0.0.1", "host:0", "host:65536", "host:8x", "[::1",
                                   "[nope]:80", "-a.com", "a..com", "x" * 64 + ".com", "a." * 130 + "com",
                                   "http://a.com", "a.com/path", "a_b.com"])
def test_bad_allow_list_entries_are_refused(entry: str) -> None:
    with pytest.raises(BadRule):
        AllowList.parse(["ok.com", entry])


def test_ceiling() -> None:
    ceiling = AllowList.parse(["*.pypi.org", "files.example.com:443"])
    assert AllowList.parse(["a.pypi.org", "*.x.pypi.org:443", "files.example.com:443"]).outside(ceiling) is None
    assert AllowList.parse(["a.pypi.org", "pypi.org"]).outside(ceiling) == 1
    assert AllowList.parse(["files.example.com"]).outside(ceiling) == 0  # any port is more than 443
    assert HostRule.parse("*.a.com").within(HostRule.parse("*.com"))


@pytest.mark.parametrize(("address", "port", "refused"), [
    ("169.254.169.254", 80, "link-local"),  # the metadata service
    ("fe80::1", 80, "link-local"),
    ("0.0.0.0", 80, "unspecified"),
    ("224.0.0.1", 80, "multicast"),
    ("::ffff:169.254.169.254", 80, "link-local"),  # IPv4-mapped: judged as the IPv4 address
    ("127.0.0.1", 8000, "own listening port"),  # the broker's, even though loopback is allowed
    ("127.0.0.5", 8000, "own listening port"),
    ("10.1.2.3", 8000, "own listening port"),  # an interface of the node is the node too
    ("::ffff:127.0.0.1", 8000, "own listening port"),
    ("127.0.0.1", 2375, "deny_ports"),  # the Docker engine's TCP port
    ("93.184.216.34", 6379, "deny_ports"),
    ("192.168.1.1", 80, "private"),
    ("100.64.0.1", 80, "private"),
    ("fd00::1", 80, "private"),
    ("127.0.0.1", 8001, None),
    ("93.184.216.34", 443, None),
])
def test_address_rules_after_resolution(address: str, port: int, refused: str | None) -> None:
    reason = LOOPBACK_RULES.refusal(ipaddress.ip_address(address), port, NODE)
    assert (reason is None) if refused is None else (reason is not None and refused in reason), reason


def test_loopback_is_closed_by_default() -> None:
    assert "allow_loopback" in (AddressRules().refusal(ipaddress.ip_address("127.0.0.1"), 8001, NODE) or "")


@pytest.mark.parametrize(("head", "status"), [
    (b"GET http://a.com/x HTTP/1.1\r\nHost: a.com\r\n\r\n", None),
    (b"CONNECT a.com:443 HTTP/1.1\r\n\r\n", None),
    (b"GET /x HTTP/1.1\r\nHost: a.com\r\n\r\n", 400),  # origin form: not a proxy request
    (b"GET https://a.com/ HTTP/1.1\r\n\r\n", 405),
    (b"CONNECT a.com HTTP/1.1\r\n\r\n", 400),
    (b"GET http://u:p@a.com/ HTTP/1.1\r\n\r\n", 400),
    (b"GET http://a.com:99999/ HTTP/1.1\r\n\r\n", 400),
    (b"GET http:///x HTTP/1.1\r\n\r\n", 400),
    (b"GET  http://a.com/ HTTP/1.1\r\n\r\n", 400),
    (b"get http://a.com/ HTTP/1.1\r\n\r\n", 400),
    (b"GET http://a.com/ HTTP/2\r\n\r\n", 400),
    (b"GET http://a.com/ HTTP/1.1\r\nno colon\r\n\r\n", 400),
    (b"GET http://a.com/ HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431),
    (b"\r\n\r\n", 400),
    (b"\xff\xfe\r\n\r\n", 400),
])
def test_request_heads(head: bytes, status: int | None) -> None:
    if status is None:
        parse_head(head)
        return
    with pytest.raises(Refused) as refused:
        parse_head(head)
    assert refused.value.status == status


def test_a_forwarded_request_is_in_origin_form_without_hop_headers() -> None:
    request = parse_head(b"POST http://A.com:8080/p?q=1 HTTP/1.1\r\nHost: a.com:8080\r\nProxy-Connection: keep-alive"
                         b"\r\nProxy-Authorization: x\r\nContent-Length: 2\r\n\r\n")
    assert (request.host, request.port) == ("a.com", 8080)
    assert request.forward == (b"POST /p?q=1 HTTP/1.1\r\nHost: a.com:8080\r\nContent-Length: 2\r\nConnection: close"
                               b"\r\n\r\n")


def test_network_in_an_exec_spec() -> None:
    limits = ExecLimits()
    spec = parse_exec_spec({"command": "true", "network": {"mode": "proxy", "allow": ["PyPI.org", "*.a.com:443"]}},
                           limits)
    assert spec.network == ("pypi.org", "*.a.com:443")
    assert parse_exec_spec({"command": "true", "network": {"mode": "none"}}, limits).network is None
    for network, field in [({"mode": "proxy"}, "spec.network.allow"),
                           ({"mode": "none", "allow": ["a.com"]}, "spec.network.allow"),
                           ({"mode": "proxy", "allow": ["a.com", "bad host"]}, "spec.network.allow[1]"),
                           ({"mode": "proxy", "allow": ["a.com"] * (MAX_RULES + 1)}, "spec.network.allow")]:
        with pytest.raises(Unprocessable) as error:
            parse_exec_spec({"command": "true", "network": network}, limits)
        assert error.value.field == field


def test_egress_config_admits_within_its_ceiling() -> None:
    off = parse_cpu_config({}).egress
    with pytest.raises(Unprocessable) as error:
        off.admit(("a.com",), "network")
    assert error.value.field == "network.mode"
    on = parse_cpu_config({"egress": {"enabled": True, "allow": ["*.pypi.org"]}}).egress
    on.admit(("files.pypi.org",), "network")
    with pytest.raises(Unprocessable) as error:
        on.admit(("files.pypi.org", "evil.com"), "network")
    assert error.value.field == "network.allow[1]"
    with pytest.raises(ConfigError):
        parse_cpu_config({"egress": {"allow": ["not a host"]}})


async def exchange(path: str, data: bytes, *, read_all: bool = True) -> bytes:
    """Send ``data`` and end the request's side, then read the answer (all of it, or its first chunk)."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read() if read_all else reader.read(65536), 5)
    writer.close()
    return answer


@pytest.fixture
async def proxy(tmp_path: Path):
    """A proxy on a unix socket that lets through 127.0.0.1 on any port, and the servers of this process."""
    path = str(tmp_path / "proxy.sock")
    proxy = EgressProxy("env-test", AllowList.parse(["127.0.0.1", "localhost"]), LOOPBACK_RULES)
    await proxy.start(path)
    yield path
    await proxy.close()


@pytest.mark.slow
async def test_proxy_forwards_http_and_tunnels_connect(proxy: str) -> None:
    with server("http", "allowed") as http_port, server("echo") as echo_port:
        answer = await exchange(proxy, f"GET http://localhost:{http_port}/a HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"hello from allowed /a")
        reader, writer = await asyncio.open_unix_connection(proxy)
        writer.write(f"CONNECT 127.0.0.1:{echo_port} HTTP/1.1\r\n\r\n".encode())
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == \
            b"HTTP/1.1 200 Connection established\r\n\r\n"
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_proxy_refuses_what_the_policy_does_not_allow(proxy: str) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)  # this process's: the broker's
    own_port = server.sockets[0].getsockname()[1]
    async with server:
        answer = await exchange(proxy, f"GET http://127.0.0.1:{own_port}/ HTTP/1.1\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 403") and b"own listening port" in answer
    answer = await exchange(proxy, b"CONNECT 127.0.0.2:443 HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403") and b"network.allow" in answer
    answer = await exchange(proxy, b"GET http://127.0.0.1:2375/containers/json HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403") and b"deny_ports" in answer


async def test_malformed_and_oversize_heads_are_answered_at_once(proxy: str) -> None:
    assert (await exchange(proxy, b"hello\r\n\r\n")).startswith(b"HTTP/1.1 400")
    oversize = b"GET http://127.0.0.1/ HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES
    assert (await exchange(proxy, oversize, read_all=False)).startswith(b"HTTP/1.1 431")
    assert await exchange(proxy, b"GET http://127.0.0.1/ HTTP/1.1\r\n") == b""  # ended before its head did


def test_relay_carries_a_connection_to_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "up.sock")
    upstream = socket.socket(socket.AF_UNIX)
    upstream.bind(path)
    upstream.listen()

    def answer() -> None:
        connection, _ = upstream.accept()
        with connection:
            connection.sendall(connection.recv(100).upper())
    threading.Thread(target=answer, daemon=True).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    egress_relay.start(f"{port}:{path}")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(b"ping")
        assert client.recv(100) == b"PING"
        assert client.recv(100) == b""
    upstream.close()
