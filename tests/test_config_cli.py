"""Config errors name the key; the CLI serves and reports status over real HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tangram.config import load_config, parse_config
from tangram.errors import ConfigError


@pytest.mark.parametrize("raw,key", [
    ({"server": {"prot": 1}}, "server.prot"),
    ({"server": {"port": "80"}}, "server.port"),
    ({"scheduler": {"depth": 0}}, "scheduler.depth"),
    ({"server": {"status_interval_s": 0}}, "server.status_interval_s"),
    ({"server": {"status_interval_s": 5, "status_keep_s": 1}}, "server.status_keep_s"),
    ({"scheduler": {"horizon": -1}}, "scheduler.horizon"),
    ({"basic": {"api.x": {}}}, "basic.api.x"),
    ({"basic": {"api.x": {"concurrency": 0}}}, "basic.api.x.concurrency"),
    ({"basic": {"api.x": {"concurrency": 1, "upstream": {"base_url": "ftp://x"}}}}, "basic.api.x.upstream.base_url"),
    ({"basic": {"api.x": {"concurrency": 1, "colour": 1}}}, "basic.api.x.colour"),
    ({"pools": {"cpu": {"n0": 0}}}, "pools.cpu.n0"),
    ({"pools": {"lease.local": {"n0": 1}}}, "lease.local"),
    ({"extra": {}}, "extra"),
])
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert error.value.key == key, str(error.value)


def test_defaults_serve_a_laptop_and_files_load(tmp_path):
    defaults = load_config(None)
    assert defaults.server.port == 8300 and defaults.store.url.startswith("sqlite")
    assert [b.name for b in defaults.basic] == ["lease.local"]
    path = tmp_path / "t.toml"
    path.write_text('[server]\nport = 9000\n[basic."api.s"]\nquota = 600\nperiod_s = 60\n')
    config = load_config(path)
    assert config.server.port == 9000 and config.basic[0].quota == 600
    path.write_text("[server\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_environment_names_the_file_and_overrides_the_store_url(tmp_path):
    """Deployments keep the database password in a Secret: $TANGRAM_STORE_URL wins over the file's store.url."""
    path = tmp_path / "t.toml"
    path.write_text('[server]\nport = 9001\n[store]\nurl = "sqlite+aiosqlite:///file.db"\n')
    from_file = load_config(None, {"TANGRAM_CONFIG": str(path)})
    assert from_file.server.port == 9001 and from_file.store.url == "sqlite+aiosqlite:///file.db"
    secret = "postgresql+asyncpg://tangram:pw@db:5432/tangram"
    overridden = load_config(None, {"TANGRAM_CONFIG": str(path), "TANGRAM_STORE_URL": secret})
    assert overridden.server.port == 9001 and overridden.store.url == secret
    assert load_config(path, {"TANGRAM_CONFIG": "/nonexistent.toml"}).server.port == 9001  # --config wins
    assert load_config(None, {}).store.url.startswith("sqlite")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_and_status_end_to_end(tmp_path):
    port = free_port()
    config = tmp_path / "tangram.toml"
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path}/t.db"\n')
    server = subprocess.Popen([sys.executable, "-m", "tangram.cli", "serve", "--config", str(config),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        request = urllib.request.Request(
            url + "/v1/actions?wait=true", method="POST", headers={"Content-Type": "application/json"},
            data=b'{"task": "demo", "kind": "lease", "demand": {"lease.local": 3}}')
        assert b'"succeeded"' in urllib.request.urlopen(request, timeout=10).read()
        status = subprocess.run([sys.executable, "-m", "tangram.cli", "status", "--url", url],
                                capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"})
        assert status.returncode == 0, status.stderr
        assert "lease.local" in status.stdout and "64" in status.stdout and "leases held 1" in status.stdout
        row = next(line for line in status.stdout.splitlines() if "lease.local" in line)
        assert "░░░░░░░░░░   5%" in row  # 3 of 64 units: 5 %, under half a cell
        watch = subprocess.Popen([sys.executable, "-m", "tangram.cli", "status", "--url", url, "--watch", "0.1"],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
        time.sleep(2)
        watch.send_signal(signal.SIGINT)
        watched, _ = watch.communicate(timeout=30)
        assert watch.returncode == 0 and "leases held 1" in watched
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert server.returncode == 0, output  # SIGTERM stops it cleanly, store flushed
    bad = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(tmp_path / "none.toml")],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    down = subprocess.run([sys.executable, "-m", "tangram.cli", "status", "--url", f"http://127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=30)
    assert down.returncode == 1 and "cannot reach" in down.stdout
