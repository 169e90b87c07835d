"""Egress by policy on the real Docker engine: a sandbox keeps ``network_mode: none`` and reaches the hosts of its
environment's allow-list, and nothing else, through the proxy the broker runs for it. Every destination is a server
of ours on 127.0.0.1 of this machine, in a process of its own (``tests/egress_servers.py``).

``pip install`` through the proxy is not tested: the sandbox image has no pip (``python3 -m pip`` fails there)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.docker_nodes import cpu_config, docker_engines
from tests.egress_servers import server
from tests.harness import Live, live_broker

pytestmark = pytest.mark.slow

#: the sandbox's commands reach the host's 127.0.0.1 through the proxy only when they do not bypass it for
#: 127.0.0.1, which NO_PROXY says they should (it is their own loopback): these tests want the host's
THROUGH_PROXY = {"NO_PROXY": "", "no_proxy": ""}
FETCH = """
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
except urllib.error.HTTPError as error:
    print("refused", error.code, error.read().decode().strip())
except OSError as error:
    print("unreachable", error)
"""
TUNNEL = """
import socket, sys
with socket.create_connection(("127.0.0.1", 3128), timeout=10) as s:
    s.sendall(f"CONNECT {sys.argv[1]} HTTP/1.1\\r\\nHost: {sys.argv[1]}\\r\\n\\r\\n".encode())
    head = b""
    while not head.endswith(b"\\r\\n\\r\\n"):
        head += s.recv(1)
    print(head.split(b"\\r\\n")[0].decode())
    s.sendall(b"through the tunnel")
    print(s.recv(100).decode())
"""


def config(**egress: Any) -> dict[str, Any]:
    return cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1",
                              "memory_mb": 4096}}, egress={"enabled": True, "allow_loopback": True, **egress})


async def run(live: Live, script: str, argument: str, *, trajectory: str, **spec: Any) -> str:
    body = {"task": "t", "kind": "exec", "demand": {"cpu": 1}, "trajectory": trajectory,
            "spec": {"command": ["python3", "-c", script, argument], "env": THROUGH_PROXY, **spec}}
    status, record = await live.call("POST", "/v1/actions?wait=true", json=body)
    assert status == 200 and record["state"] == "succeeded", record
    return str(record["result"]["stdout"]).strip()


async def test_proxy_reaches_the_allowed_host_only(tmp_path) -> None:
    with server("http", "allowed") as allowed, server("http", "other") as other, server("echo") as echo:
        async with live_broker(config(), str(tmp_path / "t.db")) as live:
            broker_port = int(live.url.rsplit(":", 1)[1])
            network = {"mode": "proxy", "allow": [f"127.0.0.1:{allowed}", f"localhost:{echo}",
                                                  f"127.0.0.1:{broker_port}"]}
            out = await run(live, FETCH, f"http://127.0.0.1:{allowed}/x", trajectory="p", network=network)
            assert out == "hello from allowed /x"
            out = await run(live, FETCH, f"http://127.0.0.1:{other}/x", trajectory="p")
            assert out.startswith("refused 403") and "network.allow" in out, out
            # the broker's own port, though the allow-list names it
            out = await run(live, FETCH, f"http://127.0.0.1:{broker_port}/v1/health", trajectory="p")
            assert out.startswith("refused 403") and "own listening port" in out, out
            out = await run(live, TUNNEL, f"localhost:{echo}", trajectory="p")
            assert out == "HTTP/1.1 200 Connection established\nthrough the tunnel", out
            out = await run(live, TUNNEL, f"127.0.0.1:{other}", trajectory="p")
            assert out.startswith("HTTP/1.1 403"), out
            # its proxy's directory is the sandbox's to connect in, not to write in
            _, record = await live.call("POST", "/v1/actions?wait=true", json={
                "task": "t", "kind": "exec", "demand": {"cpu": 1}, "trajectory": "p",
                "spec": {"command": "ls /run/tangram-egress; touch /run/tangram-egress/x"}})
            assert record["result"]["stdout"].strip() == "proxy.sock" and record["result"]["exit_code"] != 0, record
            # without a network, the same sandbox image reaches nothing, and has no proxy
            out = await run(live, FETCH, f"http://127.0.0.1:{allowed}/x", trajectory="n")
            assert out.startswith("unreachable"), out
            out = await run(live, "import os, sys; print(os.environ.get(sys.argv[1]))", "HTTP_PROXY",
                            trajectory="n")
            assert out == "None"


async def test_environments_api_takes_a_network_and_checks_it(tmp_path) -> None:
    with server("http", "allowed") as allowed:
        async with live_broker(config(allow=["127.0.0.1", "*.test"]), str(tmp_path / "t.db")) as live:
            status, answer = await live.call("POST", "/v1/environments", json={
                "task": "t", "trajectory": "a", "network": {"mode": "proxy", "allow": ["127.0.0.1", "evil.com"]}})
            assert status == 422 and answer["error"]["field"] == "network.allow[1]", answer
            status, answer = await live.call("POST", "/v1/environments", json={
                "task": "t", "trajectory": "a", "network": {"mode": "proxy", "allow": ["a b"]}})
            assert status == 422 and answer["error"]["field"] == "network.allow[0]", answer
            status, env = await live.call("POST", "/v1/environments", json={
                "task": "t", "trajectory": "a", "network": {"mode": "proxy", "allow": ["127.0.0.1"]}})
            assert status == 201 and env["network"] == {"mode": "proxy", "allow": ["127.0.0.1"]}, env
            out = await run(live, FETCH, f"http://127.0.0.1:{allowed}/y", trajectory="a")
            assert out == "hello from allowed /y"
            status, answer = await live.call("POST", "/v1/actions", json={
                "task": "t", "kind": "exec", "demand": {"cpu": 1}, "trajectory": "a",
                "spec": {"command": "true", "network": {"mode": "proxy", "allow": ["x.test"]}}})
            assert status == 422 and answer["error"]["field"] == "spec.network", answer
            status, answer = await live.call("DELETE", f"/v1/environments/{env['id']}")
            assert status == 200, answer


async def test_a_broker_without_egress_refuses_a_network(tmp_path) -> None:
    raw = cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1",
                             "memory_mb": 4096}})
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        status, answer = await live.call("POST", "/v1/actions", json={
            "task": "t", "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": "true", "network": {"mode": "proxy", "allow": ["127.0.0.1"]}}})
        assert status == 422 and answer["error"]["field"] == "spec.network.mode", json.dumps(answer)


async def test_a_restarted_broker_runs_an_adopted_sandboxs_proxy_again(tmp_path) -> None:
    raw = config()
    raw["cpu"]["keep_sandboxes_on_stop"] = True
    with server("http", "allowed") as allowed, server("http", "other") as other:
        network = {"mode": "proxy", "allow": [f"127.0.0.1:{allowed}"]}
        async with live_broker(raw, str(tmp_path / "t.db")) as live:
            assert await run(live, FETCH, f"http://127.0.0.1:{allowed}/1", trajectory="k", network=network) == \
                "hello from allowed /1"
        raw["cpu"]["keep_sandboxes_on_stop"] = False
        async with live_broker(raw, str(tmp_path / "t.db")) as live:
            assert await run(live, FETCH, f"http://127.0.0.1:{allowed}/2", trajectory="k") == "hello from allowed /2"
            out = await run(live, FETCH, f"http://127.0.0.1:{other}/2", trajectory="k")
            assert out.startswith("refused 403"), out
            _, envs = await live.call("GET", "/v1/environments")
            assert [env["network"] for env in envs["environments"]] == [network]
