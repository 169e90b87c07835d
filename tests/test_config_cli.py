"""Config errors name the key; the CLI serves and reports status over real HTTP."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tangram.cli import main
from tangram.config import ADMIN_TOKEN_ENV, ADVERTISE_URL_ENV, load_config, parse_config
from tangram.core.errors import ConfigError
from tangram.sched.profile import DEFAULT_PROFILE, MOVED, ElasticArgs, EstimateArgs, HrrsArgs
from tangram.server.auth import new_token, token_sha256
from tangram.slo.plan import SloPlan

#: a valid ``[tasks.NAME.slo]`` table
SLO = {"slowdown": 1.2, "service": "judge", "actions": 8, "action_s": 2.0, "other_s": 30.0, "dedicated_gpus": 1}


@pytest.mark.parametrize("raw,key", [
    ({"server": {"prot": 1}}, "server.prot"),
    ({"server": {"port": "80"}}, "server.port"),
    ({"scheduler": {"elastic": {"depth": 0}}}, "scheduler.elastic.depth"),
    ({"server": {"status_interval_s": 0}}, "server.status_interval_s"),
    ({"server": {"status_interval_s": 5, "status_keep_s": 1}}, "server.status_keep_s"),
    ({"scheduler": {"elastic": {"horizon": -1}}}, "scheduler.elastic.horizon"),
    ({"basic": {"api.x": {}}}, "basic.api.x.concurrency"),
    ({"basic": {"api.x": {"concurrency": 0}}}, "basic.api.x.concurrency"),
    ({"basic": {"api.x": {"concurrency": 1, "upstream": {"base_url": "ftp://x"}}}}, "basic.api.x.upstream.base_url"),
    ({"basic": {"api.x": {"concurrency": 1, "colour": 1}}}, "basic.api.x.colour"),
    ({"pools": {"cpu": {"n0": 0}}}, "pools.cpu.n0"),
    ({"pools": {"lease.local": {"n0": 1}}}, "lease.local"),
    ({"extra": {}}, "extra"),
    ({"ray": {"auth": "maybe"}}, "ray.auth"),
    ({"scheduler": {"queue_order_by_resource": {"gpux": "hrrs"}}}, "scheduler.queue_order_by_resource.gpux"),
    ({"scheduler": {"queue_order_by_resource": {"lease.local": "sjf"}}},
     "scheduler.queue_order_by_resource.lease.local"),  # no such order
    ({"scheduler": {"queue_order": "sjf"}}, "scheduler.queue_order"),
    ({"scheduler": {"sjf": {}}}, "scheduler.sjf"),  # no such plugin
    ({"scheduler": {"fcfs": {}}}, "scheduler.fcfs"),  # a plugin without arguments
    ({"scheduler": {"hrrs": {"max_wait": 1.0}}}, "scheduler.hrrs.max_wait"),  # no such argument
    ({"scheduler": {"hrrs": {"max_wait_s": -1.0}}}, "scheduler.hrrs.max_wait_s"),
    ({"scheduler": {"elastic": {"share_by": "size"}}}, "scheduler.elastic.share_by"),
    ({"scheduler": {"estimates": {"ewma_alpha": 1.5}}}, "scheduler.estimates.ewma_alpha"),
    ({"cpu": {"ray_address": "head:6379"}}, "cpu.ray_address"),
    ({"gpu": {"ray": {"address": "head:6379"}}}, "gpu.ray"),
    ({"tasks": {"t": {"slo": {**SLO, "slowdown": 0.9}}}}, "tasks.t.slo.slowdown"),  # out of SloPlan's range
    ({"tasks": {"t": {"slo": {**SLO, "efficiency": 1.5}}}}, "tasks.t.slo.efficiency"),
    ({"tasks": {"t": {"slo": {**SLO, "actions": [1]}}}}, "tasks.t.slo.actions"),
    ({"tasks": {"t": {"slo": {**SLO, "colour": 1}}}}, "tasks.t.slo.colour"),
    ({"tasks": {"t": {"slo": {k: v for k, v in SLO.items() if k != "service"}}}}, "tasks.t.slo.service"),
    ({"tasks": {"t": {"slo": 1.2}}}, "tasks.t.slo"),
])
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert error.value.key == key, str(error.value)


def test_a_tasks_slo_table_is_its_plan_beside_its_caps():
    access = parse_config({"tasks": {"t": {"max_running": 3, "slo": SLO}, "u": {"max_running": 1}}}).access
    assert access.slo_plans == {"t": SloPlan(**SLO)}
    assert access.tenancy.tasks["t"].max_running == 3


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


def test_the_ray_section_reaches_both_managers_and_older_keys_say_where_they_went():
    config = parse_config({"ray": {"address": "head:6379", "auth": "none"}})
    assert config.cpu.ray == config.gpu.ray and (config.gpu.ray.address, config.gpu.ray.auth) == ("head:6379", "none")
    assert parse_config({}).cpu.ray.auth == "token"  # the default refuses a cluster without its token
    with pytest.raises(ConfigError, match=r"now \[ray\] auth"):
        parse_config({"cpu": {"ray_auth": "none"}})


SCHEDULER_PROFILE = """
[scheduler]
queue_order = "fcfs"
queue_order_by_resource = { "lease.local" = "hrrs" }
max_queue = 500

[scheduler.hrrs]
max_wait_s = 30.0
overdue_floor_s = 5.0

[scheduler.elastic]
depth = 3
horizon = 32
share_by = "remaining"

[scheduler.estimates]
default_duration_s = 2.0
ewma_alpha = 0.5
arrivals = false
"""


def test_the_scheduler_profile_is_read_from_its_plugin_tables(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(SCHEDULER_PROFILE)
    scheduler = load_config(path).scheduler
    assert scheduler.ordered_by("hrrs", ["lease.local", "cpu"]) == ["lease.local"]
    assert scheduler.ordered_by("fcfs", ["lease.local", "cpu"]) == ["cpu"]
    assert scheduler.hrrs == HrrsArgs(max_wait_s=30.0, overdue_floor_s=5.0)
    assert scheduler.elastic == ElasticArgs(depth=3, horizon=32, share_by="remaining")
    assert scheduler.estimates == EstimateArgs(default_duration_s=2.0, ewma_alpha=0.5, arrivals=False)
    assert scheduler.max_queue == 500 and "max_queue" not in scheduler.to_json()  # the broker's, not the profile's
    assert parse_config({}).scheduler.to_json() == DEFAULT_PROFILE.to_json()
    assert parse_config({"server": {"max_wait_s": 10.0}}).server.max_wait_s == 10.0  # ?wait=true's bound stays


#: each key ``[scheduler]`` held before the profile, and the place it moved to (table, key)
MOVED_TO = {"policy": ("", "queue_order"), "order": ("", "queue_order_by_resource"),
            "max_wait_s": ("hrrs", "max_wait_s"), "overdue_floor_s": ("hrrs", "overdue_floor_s"),
            "depth": ("elastic", "depth"), "horizon": ("elastic", "horizon"),
            "default_duration_s": ("estimates", "default_duration_s"), "ewma_alpha": ("estimates", "ewma_alpha")}


@pytest.mark.parametrize("key", sorted(MOVED_TO))
def test_a_scheduler_key_the_profile_moved_is_refused_naming_its_new_place(key):
    plugin, new_key = MOVED_TO[key]
    with pytest.raises(ConfigError) as error:
        parse_config({"scheduler": {key: 1}})
    place = f"[scheduler.{plugin}] {new_key}" if plugin else f"[scheduler] {new_key}"
    assert error.value.key == f"scheduler.{key}" and place in str(error.value), str(error.value)
    table = getattr(DEFAULT_PROFILE, plugin) if plugin else DEFAULT_PROFILE
    assert hasattr(table, new_key), "the new place exists"
    assert set(MOVED_TO) == set(MOVED)


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


def test_leader_election_in_the_file_is_checked_against_the_store_url_of_the_environment(tmp_path):
    """A ConfigMap says leader_election and leaves the URL (with its password) to the Secret: the file alone would
    name SQLite, which cannot elect, and is refused; with the environment's PostgreSQL URL it loads."""
    path = tmp_path / "t.toml"
    path.write_text("[store]\nleader_election = true\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, {})
    assert refused.value.key == "store.leader_election"
    secret = "postgresql+asyncpg://tangram:pw@db:5432/tangram"
    config = load_config(path, {"TANGRAM_STORE_URL": secret})
    assert config.store.leader_election and config.store.url == secret
    with pytest.raises(ConfigError):
        load_config(path, {"TANGRAM_STORE_URL": "sqlite+aiosqlite:///x.db"})


def test_each_replica_advertises_the_url_its_environment_names(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[server]\nhost = "0.0.0.0"\nadvertise_url = "http://file:8300"\n')
    assert load_config(path, {}).server.url() == "http://file:8300"
    assert load_config(path, {ADVERTISE_URL_ENV: "http://10.1.2.3:8300"}).server.url() == "http://10.1.2.3:8300"
    for bad in ("10.1.2.3:8300", "http://10.1.2.3:8300/v1", "ftp://x", "http://a b"):
        with pytest.raises(ConfigError) as refused:
            load_config(path, {ADVERTISE_URL_ENV: bad})
        assert refused.value.key == ADVERTISE_URL_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
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
                                capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"},
                                check=False)
        assert status.returncode == 0, status.stderr
        assert "lease.local" in status.stdout and "64" in status.stdout and "leases held 1" in status.stdout
        row = next(line for line in status.stdout.splitlines() if "lease.local" in line)
        assert "░░░░░░░░░░   5%" in row  # 3 of 64 units: 5 %, under half a cell
        watch = subprocess.Popen([sys.executable, "-m", "tangram.cli", "status", "--url", url, "--watch", "0.1"],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
        time.sleep(5)  # past its start-up (imports take seconds on a loaded 2-core machine) and a few refreshes
        watch.send_signal(signal.SIGINT)
        watched, _ = watch.communicate(timeout=30)
        assert watch.returncode == 0 and "leases held 1" in watched
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert server.returncode == 0, output  # SIGTERM stops it cleanly, store flushed
    bad = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(tmp_path / "none.toml")],
                         capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    down = subprocess.run([sys.executable, "-m", "tangram.cli", "status", "--url", f"http://127.0.0.1:{free_port()}"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert down.returncode == 1 and "cannot reach" in down.stdout


# -- the admin named by $TANGRAM_ADMIN_TOKEN_SHA256 -------------------------------------------------------------


def test_admin_token_hashes_from_the_environment_add_to_the_files(tmp_path):
    """A deployment's Secret names the admin without touching the config file: the variable's hashes (comma-
    separated while a token is rotated, case and spaces forgiven) come after the file's, each once; empty is unset,
    as Compose's ``${VAR:-}`` leaves it."""
    in_file, first, second = (token_sha256(new_token()) for _ in range(3))
    path = tmp_path / "t.toml"
    path.write_text(f'[auth]\nrequired = true\nadmin_token_sha256 = "{in_file}"\n')
    config = load_config(path, {ADMIN_TOKEN_ENV: f" {first.upper()} ,{second},{in_file}"})
    assert config.access.auth.admin_token_sha256 == (in_file, first, second)
    assert config.access.auth.required is True and config.access.source == str(path)
    for unset in ({}, {ADMIN_TOKEN_ENV: ""}, {ADMIN_TOKEN_ENV: "  "}):
        assert load_config(path, unset).access.auth.admin_token_sha256 == (in_file,)
    assert load_config(None, {ADMIN_TOKEN_ENV: first}).access.auth.admin_token_sha256 == (first,)


DIGEST = token_sha256(new_token())
MALFORMED_ADMIN_VALUES = {"the token itself": new_token(), "63 digits": DIGEST[:-1], "not hex": "g" + DIGEST[1:],
                          "trailing comma": f"{DIGEST},", "semicolon": f"{DIGEST};{DIGEST}",
                          "space": f"{DIGEST} {DIGEST}"}


@pytest.mark.parametrize("value", MALFORMED_ADMIN_VALUES.values(), ids=MALFORMED_ADMIN_VALUES.keys())
def test_malformed_admin_hash_in_the_environment_names_the_variable(value):
    """A token pasted where its hash belongs, a truncated digest or a bad separator stops the broker with an
    error naming the variable; the error never repeats the value, which may be the token itself."""
    with pytest.raises(ConfigError) as error:
        load_config(None, {ADMIN_TOKEN_ENV: value})
    assert error.value.key == ADMIN_TOKEN_ENV and "tangram token hash" in str(error.value)
    assert value not in str(error.value)


def test_admin_hash_in_the_environment_cannot_also_be_a_tasks_token(tmp_path):
    """A token belongs to one task or to the admin: the environment cannot promote a task's token to admin."""
    path = tmp_path / "t.toml"
    path.write_text(f'[tasks.rl]\ntoken_sha256 = "{DIGEST}"\n')
    with pytest.raises(ConfigError) as error:
        load_config(path, {ADMIN_TOKEN_ENV: DIGEST})
    assert error.value.key == ADMIN_TOKEN_ENV and "tasks.rl.token_sha256" in str(error.value)


def call(url: str, method: str, token: str | None = None, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_reload_keeps_the_admin_named_by_the_environment(tmp_path):
    """``POST /v1/admin/reload`` reads the config file again; the admin that only $TANGRAM_ADMIN_TOKEN_SHA256 names
    stays the admin (else a reload would lock the operator out), and the file's new task token applies."""
    admin, rl_token = new_token(), new_token()
    db, config = tmp_path / "t.db", tmp_path / "tangram.toml"
    closed = f'[store]\nurl = "sqlite+aiosqlite:///{db}"\n[cpu]\nenabled = false\n[auth]\nrequired = true\n'
    config.write_text(closed)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tangram.cli", "serve", "--config", str(config),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, ADMIN_TOKEN_ENV: token_sha256(admin), "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < end, "the broker did not start"
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        lease = {"task": "rl", "kind": "lease", "demand": {"lease.local": 1}}
        assert call(url + "/v1/actions?wait=true", "POST", body=lease)[0] == 401
        status, listing = call(url + "/v1/admin/tokens", "GET", admin)
        assert status == 200 and [t["admin"] for t in listing["tokens"]] == [True]
        config.write_text(closed + f'[tasks.rl]\ntoken_sha256 = "{token_sha256(rl_token)}"\n')
        status, reloaded = call(url + "/v1/admin/reload", "POST", admin)
        assert status == 200 and reloaded["auth"] is True and reloaded["tokens"] == 2, reloaded
        assert call(url + "/v1/admin/tokens", "GET", admin)[0] == 200
        status, record = call(url + "/v1/actions?wait=true", "POST", rl_token, lease)
        assert status == 200 and record["state"] == "succeeded", record
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert server.returncode == 0, output
    bad = subprocess.run([sys.executable, "-m", "tangram.cli", "serve", "--config", str(config)], check=False,
                         capture_output=True, text=True, timeout=60, env={**os.environ, ADMIN_TOKEN_ENV: admin})
    assert bad.returncode == 2 and ADMIN_TOKEN_ENV in bad.stderr and admin not in bad.stderr


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out == f"tangram {importlib.metadata.version('arl-tangram')}\n"
