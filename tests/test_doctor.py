"""``tangram config check`` and ``tangram doctor`` against real files, a real SQLite store and real Docker engines."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from tangram.cli import main
from tests.docker_nodes import docker_engines


def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "broker.toml"
    path.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path}/doctor.db"\n' + body)
    return str(path)


def _docker_node(engine: str, image: str | None = None) -> str:
    default_image = f'default_image = "{image}"\n' if image else ""
    return (f'[cpu]\nbroker_id = "doctor"\nrun_dir = "/tmp/tg-doctor"\n{default_image}'
            f'[cpu.nodes.n0]\nengine = "{engine}"\nfast_path = false\n[gpu]\nenabled = false\n')


def test_config_check_prints_ok_and_a_summary_with_the_password_hidden(tmp_path, capsys):
    path = tmp_path / "broker.toml"
    path.write_text('[store]\nurl = "postgresql+asyncpg://tangram:s3cret@db:5432/tangram"\n'
                    '[cpu]\nenabled = false\n[basic."api.search"]\nconcurrency = 2\n')
    assert main(["config", "check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "ok"
    assert "postgresql+asyncpg://tangram:***@db:5432/tangram" in out and "s3cret" not in out
    assert "basic (api.search), cpu off" in out


def test_config_check_names_the_bad_field_and_exits_2(tmp_path, capsys):
    path = _write(tmp_path, "[server]\nport = 70000\n")
    assert main(["config", "check", "--config", path]) == 2
    captured = capsys.readouterr()
    assert "ok" not in captured.out and "server.port" in captured.err


def test_doctor_reports_a_bad_config_as_a_failure(tmp_path, capsys):
    path = _write(tmp_path, "[server]\nprot = 1\n")
    assert main(["doctor", "--config", path]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("FAIL config: server.prot: ") and "fix:" in line


def test_doctor_passes_a_docker_node_with_its_image_and_a_sqlite_store(tmp_path, capsys):
    path = _write(tmp_path, _docker_node(docker_engines()[0]))
    assert main(["doctor", "--config", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("PASS node n0: ") for line in lines) == 4  # engine, cgroup, image, runnable
    assert f"PASS node n0: engine: {docker_engines()[0]} answers" in lines
    assert "PASS node n0: runnable: python3 runs with no network and no capabilities" in lines
    assert lines[0].startswith("PASS config") and lines[1].startswith("PASS store")
    assert all(line.startswith(("PASS", "SKIP")) for line in lines)
    assert main(["doctor", "--config", path, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    by_name = {result["check"]: result for result in results}
    assert [by_name[f"node n0: {what}"]["status"] for what in ("engine", "cgroup", "image", "runnable")] == \
        ["PASS"] * 4
    assert by_name["node n0: cgroup"]["detail"].startswith("cgroup v")
    assert {result["status"] for result in results} <= {"PASS", "SKIP"}


def test_doctor_fails_a_missing_default_image_with_the_build_hint(tmp_path, capsys):
    engine = docker_engines()[0]
    path = _write(tmp_path, _docker_node(engine, image="tangram/no-such-image:never"))
    assert main(["doctor", "--config", path]) == 1
    out = capsys.readouterr().out
    image = next(line for line in out.splitlines() if line.startswith(("PASS node n0: image", "FAIL node n0: image")))
    assert image.startswith("FAIL") and f"tangram image build --name tangram/no-such-image:never --engine {engine}" \
        in image
    assert "SKIP node n0: runnable: the image is missing" in out


def test_doctor_fails_an_engine_that_is_not_there_at_once(tmp_path, capsys):
    path = _write(tmp_path, _docker_node("unix:///nonexistent.sock"))
    began = time.monotonic()
    assert main(["doctor", "--config", path]) == 1
    assert time.monotonic() - began < 30
    out = capsys.readouterr().out
    assert "FAIL node n0: engine: unix:///nonexistent.sock does not answer" in out
    assert "SKIP node n0: image: the engine does not answer" in out
    assert "PASS store" in out  # the other checks still ran


@pytest.mark.slow
def test_doctor_bounds_an_engine_that_accepts_and_never_answers(tmp_path, capsys):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        body = _docker_node(f"tcp://127.0.0.1:{port}").replace("fast_path = false\n",
                                                               'cores = "0"\nmemory_mb = 512\n')
        began = time.monotonic()
        assert main(["doctor", "--config", _write(tmp_path, body)]) == 1
        assert time.monotonic() - began < 30
    assert f"FAIL node n0: engine: tcp://127.0.0.1:{port} does not answer" in capsys.readouterr().out


@pytest.mark.slow  # imports Ray
def test_doctor_fails_a_ray_cluster_that_refuses_connections(tmp_path, capsys):
    with socket.socket() as closed:  # a loopback port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    body = (f'[ray]\naddress = "127.0.0.1:{port}"\nauth = "none"\n[cpu]\nbroker_id = "doctor"\n[cpu.join]\n'
            f'[gpu]\nenabled = false\n')
    assert main(["doctor", "--config", _write(tmp_path, body)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL ray: cluster '127.0.0.1:{port}' not reachable" in out and "ray start --head" in out
    assert "SKIP docker: no CPU node with backend \"docker\"" in out
