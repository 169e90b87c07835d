"""Egress by policy on the real Docker engine: a sandbox keeps ``network_mode: none`` and reaches the hosts of its
environment's allow-list, and nothing else, through the proxy the broker runs for it. Every destination is a server
of ours on 127.0.0.1 of this machine, in a process of its own (``tests/egress_servers.py``); ``pip install`` runs
against a package index of ours the same way (the sandbox image has no pip: this process's own is written into the
sandbox first, through the files API)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pip
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


def tiny_wheel(directory: Path) -> str:
    """A pure-Python wheel of ``tinypkg`` 1.0 (``ANSWER = 42``) in ``directory``: its file name."""
    files = {"tinypkg/__init__.py": b"ANSWER = 42\n",
             "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
             "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    digest = {name: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
              for name, data in files.items()}
    record = "".join(f"{name},sha256={digest[name]},{len(data)}\n" for name, data in files.items())
    files["tinypkg-1.0.dist-info/RECORD"] = (record + "tinypkg-1.0.dist-info/RECORD,,\n").encode()
    name = "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(directory / name, "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return name


def package_index(root: Path) -> Path:
    """A PEP 503 simple index of one project, ``tinypkg``, under ``root``."""
    (root / "simple" / "tinypkg").mkdir(parents=True)
    (root / "packages").mkdir()
    wheel = tiny_wheel(root / "packages")
    sha = hashlib.sha256((root / "packages" / wheel).read_bytes()).hexdigest()
    (root / "simple" / "tinypkg" / "index.html").write_text(
        f'<html><body><a href="../../packages/{wheel}#sha256={sha}">{wheel}</a></body></html>\n')
    return root


def pip_tar() -> bytes:
    """This process's pip package, without its byte code, as a tar of ``pip-src/pip/...``."""
    source = Path(pip.__file__).parent
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(source.rglob("*")):
            if path.is_file() and path.suffix != ".pyc":
                tar.add(path, arcname=f"pip-src/pip/{path.relative_to(source)}")
    return buffer.getvalue()


async def test_pip_installs_from_an_allowed_index_through_the_proxy_only(tmp_path) -> None:
    index = package_index(tmp_path / "index")
    with server("files", str(index)) as allowed, server("files", str(index)) as other:
        async with live_broker(config(), str(tmp_path / "t.db")) as live:
            status, env = await live.call("POST", "/v1/environments", json={
                "task": "t", "trajectory": "pip", "network": {"mode": "proxy", "allow": [f"127.0.0.1:{allowed}"]}})
            assert status == 201, env
            status, body = await live.call("PUT", f"/v1/environments/{env['id']}/files", data=pip_tar(),
                                           headers={"content-type": "application/x-tar"})
            assert status == 200, body

            async def pip_install(port: int) -> dict[str, Any]:
                command = (f"PYTHONPATH=pip-src python3 -m pip install --disable-pip-version-check --no-cache-dir "
                           f"--retries 0 --timeout 10 --index-url http://127.0.0.1:{port}/simple/ --target site "
                           f"tinypkg && PYTHONPATH=site python3 -c 'import tinypkg; print(tinypkg.ANSWER)'")
                _, record = await live.call("POST", "/v1/actions?wait=true", json={
                    "task": "t", "kind": "exec", "demand": {"cpu": 1}, "trajectory": "pip", "timeout_s": 120,
                    "spec": {"command": command, "env": THROUGH_PROXY}})
                assert record["state"] == "succeeded", record
                return dict(record["result"])

            installed = await pip_install(allowed)
            assert installed["exit_code"] == 0 and installed["stdout"].splitlines()[-1] == "42", installed
            refused = await pip_install(other)  # the same index, on a port the allow-list does not name
            assert refused["exit_code"] != 0 and "No matching distribution" in refused["stderr"], refused
