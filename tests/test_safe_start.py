"""Safe defaults at start (issue 35): exec never falls back to unsandboxed processes, a broker listening beyond
loopback runs with auth, the SQLite file is private and the fast path's run directory is the broker's alone."""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sandboxes.backend import SandboxError
from tangram.config import parse_config
from tangram.core.errors import ConfigError
from tangram.service import running_broker
from tests.docker_nodes import cpu_config, docker_engines, new_broker_id
from tests.harness import live_broker

pytestmark = pytest.mark.slow  # brokers started in subprocesses

TOKEN = re.compile(r"^(tgm_[A-Za-z0-9_-]{43})$", re.MULTILINE)
LEASE = b'{"task": "t", "kind": "lease", "demand": {"lease.local": 1}, "spec": {"ttl_s": 1}}'


async def test_exec_never_falls_back_to_local_processes(tmp_path: Path) -> None:
    """Without its engine, or without the image, a Docker node does not start, and the error names the fixes; it
    used to run exec as local processes with the broker's environment, saying so only in its log."""
    missing_engine = cpu_config({"n": {"engine": f"unix://{tmp_path}/no-docker.sock", "cores": "0",
                                       "memory_mb": 1024}})
    missing_image = cpu_config({"n": {"engine": docker_engines()[0], "cores": "0", "memory_mb": 1024}},
                               default_image="tangram/no-such-image:never")
    for raw, code in ((missing_engine, "engine_unavailable"), (missing_image, "image_not_found")):
        with pytest.raises(SandboxError) as refused:
            async with live_broker(raw, str(tmp_path / "t.db")):
                pass
        assert refused.value.code == code
        for fix in ("tangram image build", 'backend = "local"', "unsandboxed = true", "enabled = false"):
            assert fix in refused.value.message, refused.value.message


def test_tangram_serve_says_why_a_node_does_not_start(tmp_path: Path) -> None:
    """What an operator sees: the message and its fixes, no traceback, a non-zero exit."""
    config = tmp_path / "tangram.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path}/t.db"\n[cpu]\nbroker_id = "{new_broker_id()}"\n'
                      f'[cpu.nodes.n]\nengine = "unix://{tmp_path}/none.sock"\ncores = "0"\nmemory_mb = 1024\n')
    served = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(config), "--port",
                             str(free_port())], check=False, capture_output=True, text=True, timeout=60)
    assert served.returncode == 1 and "Traceback" not in served.stderr, served.stderr
    assert "tangram: node n: Docker engine" in served.stderr and "tangram image build" in served.stderr


@pytest.mark.parametrize(("node", "key"), [({"backend": "local"}, "cpu.nodes.n.unsandboxed"),
                                           ({"backend": "auto"}, "cpu.nodes.n.backend"),
                                           ({"unsandboxed": True}, "cpu.nodes.n.unsandboxed")])
def test_local_processes_only_when_the_config_says_unsandboxed(node: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"cpu": {"nodes": {"n": {"cores": "0", "memory_mb": 64, **node}}}})
    assert refused.value.key == key
    with pytest.raises(ConfigError) as refused:
        parse_config({"cpu": {"join": {"backend": "local"}}})
    assert refused.value.key == "cpu.join.unsandboxed"
    local = parse_config({"cpu": {"nodes": {"n": {"backend": "local", "unsandboxed": True}}}})
    assert local.cpu.nodes[0].unsandboxed


async def test_the_sqlite_file_and_its_journal_are_private(tmp_path: Path) -> None:
    db = tmp_path / "store" / "tangram.db"
    async with live_broker({"cpu": {"enabled": False}}, str(db)) as live:
        code, _ = await live.call("POST", "/v1/actions?wait=true", data=LEASE,
                                  headers={"Content-Type": "application/json"})
        assert code == 200
        await live.broker.store.flush()
        files = sorted(tmp_path.glob("store/tangram.db*"))
        assert db in files and len(files) > 1  # the database and its write-ahead log
        assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in files} == {
            path.name: 0o600 for path in files}


@pytest.mark.parametrize("flaw", ["world-writable", "foreign owner"])
async def test_the_fast_paths_run_dir_must_be_the_brokers(tmp_path: Path, flaw: str) -> None:
    """The broker connects, as root, to sockets in its run directory: a directory on the way to it that another
    user may write lets that user swap them. Refused at start, before the engine is asked or anything read."""
    shared = Path(tempfile.mkdtemp(prefix="trd-"))  # short: executor socket paths must fit in 107 bytes
    if flaw == "world-writable":
        shared.chmod(0o777)
    else:
        os.chown(shared, 65534, 65534)
    raw = cpu_config({"n": {"engine": docker_engines()[0], "cores": "0", "memory_mb": 1024, "fast_path": True}})
    raw["cpu"]["run_dir"] = str(shared / "run")
    try:
        with pytest.raises(SandboxError) as refused:
            async with running_broker(parse_config({**raw, "store": {"url": f"sqlite+aiosqlite:///{tmp_path}/t.db"}})):
                pass
        assert refused.value.code == "run_dir_unsafe" and str(shared) in refused.value.message
        assert ("chmod go-w" if flaw == "world-writable" else "chown root") in refused.value.message
        assert not (shared / "run").exists()  # nothing made or read under it
    finally:
        shutil.rmtree(shared)


# -- a broker listening beyond loopback --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def call(port: int, token: str | None = None, host: str | None = None) -> int:
    """POST a lease to the broker on loopback; the answer's status."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
               **({"Host": host} if host else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/actions", data=LEASE, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


@contextmanager
def serving(config: Path, port: int, *extra: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``tangram serve --host 0.0.0.0`` as an operator runs it; yields it and its stderr lines, read as they come,
    once it listens (on every interface, but only loopback is ever sent to)."""
    process = subprocess.Popen([sys.executable, "-m", "tangram.cli", "serve", "--config", str(config), "--host",
                                "0.0.0.0", "--port", str(port), *extra], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr or ()), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    try:
        while not any("broker listening on" in line for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        yield process, lines
    finally:
        process.terminate()
        process.wait(timeout=60)
        reader.join(timeout=10)


def broker_file(tmp_path: Path, extra: str = "") -> Path:
    config = tmp_path / "tangram.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path}/t.db"\n[cpu]\nenabled = false\n{extra}')
    return config


def test_a_first_start_beyond_loopback_makes_an_admin_token(tmp_path: Path) -> None:
    """`tangram serve --host 0.0.0.0` on defaults: auth is on before it listens, with one admin token printed once on
    stderr; the next start finds the token in the store and prints none."""
    config = broker_file(tmp_path)
    port = free_port()
    with serving(config, port) as (_, lines):
        tokens = TOKEN.findall("".join(lines))
        assert len(tokens) == 1, "".join(lines)
        assert call(port) == 401
        assert call(port, "tgm_" + "x" * 43) == 401
        assert call(port, tokens[0], host="broker.example") == 201  # with auth on, any Host may carry a token
    with serving(config, port) as (_, lines):
        assert not TOKEN.findall("".join(lines)) and call(port) == 401 and call(port, tokens[0]) == 201
    assert stat.S_IMODE((tmp_path / "t.db").stat().st_mode) == 0o600


def test_auth_turned_off_explicitly_refuses_a_wide_bind_unless_insecure(tmp_path: Path) -> None:
    config = broker_file(tmp_path, "[auth]\nrequired = false\n")
    port = free_port()
    refused = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(config), "--host",
                              "0.0.0.0", "--port", str(port)], check=False, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "auth.required" in refused.stderr and "--insecure" in refused.stderr
    with serving(config, port, "--insecure") as (_, lines):
        assert not TOKEN.findall("".join(lines))
        assert call(port) == 201  # addressed to 127.0.0.1, as through a port published on loopback
        assert call(port, host="broker.example") == 403  # the request guard: auth is off
