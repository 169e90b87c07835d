"""The default sandbox image on real Docker engines: present on every node, runs Python, pytest, xdist and git.

The engines come from TANGRAM_TEST_DOCKER_NODES (comma-separated engine URLs), which
``eval "$(bash scripts/start-docker.sh)"`` exports after starting both engines and importing the image.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

from sandboxes.image import (
    DEFAULT_IMAGE,
    IMAGE_CHANGES,
    ImageBuildError,
    ensure_image,
    image_exists,
    import_image,
    tarball_path,
)
from tests.docker_nodes import docker_engines


@pytest.fixture(scope="module")
def engines() -> list[str]:
    return docker_engines()


@pytest.fixture(params=range(2), ids=["node1", "node2"])
def engine(request: pytest.FixtureRequest, engines: list[str]) -> str:
    return engines[request.param]


@pytest.fixture
def client(engine: str) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=engine)
    try:
        yield client
    finally:
        client.close()


def _run(client: docker.DockerClient, command: list[str]) -> tuple[int, str]:
    """Run a command in a fresh container of the default image with no network; the container is always removed."""
    container = client.containers.create(DEFAULT_IMAGE, command, network_mode="none",
                                         name=f"tangram-test-image-{uuid.uuid4().hex[:12]}")
    try:
        container.start()
        status = container.wait(timeout=120)
        return int(status["StatusCode"]), container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def test_image_exists_on_every_engine(engines: list[str]) -> None:
    assert len(engines) == 2, engines
    for url in engines:
        assert image_exists(url, DEFAULT_IMAGE), f"{DEFAULT_IMAGE} missing on {url}"


def test_python_pytest_xdist_run(client: docker.DockerClient) -> None:
    code, output = _run(client, ["python3", "-c", "import pytest, xdist; print(pytest.__version__)"])
    assert code == 0, output
    assert output.strip().split(".")[0].isdigit(), output


def test_git_runs(client: docker.DockerClient) -> None:
    code, output = _run(client, ["git", "--version"])
    assert code == 0, output
    assert output.startswith("git version "), output


def test_pytest_runs_a_suite_in_workspace(client: docker.DockerClient) -> None:
    """What a sandbox is for: write a test file in the working directory and run it with xdist."""
    script = ("pwd; printf 'def test_ok():\\n    assert 1 + 1 == 2\\n' > test_x.py; "
              "python3 -m pytest -q -p no:cacheprovider -n 2 test_x.py")
    code, output = _run(client, ["sh", "-c", script])
    assert code == 0, output
    assert output.startswith("/workspace\n"), output
    assert "1 passed" in output, output


def test_image_config(client: docker.DockerClient) -> None:
    config = client.api.inspect_image(DEFAULT_IMAGE)["Config"]
    assert config["WorkingDir"] == "/workspace"
    assert config["Cmd"] == ["python3"]
    assert "LANG=C.UTF-8" in config["Env"]
    assert "PYTHONDONTWRITEBYTECODE=1" in config["Env"]
    assert any(env.startswith("PATH=/usr/local/sbin:") for env in config["Env"]), config["Env"]


def test_import_is_skipped_when_present(engine: str, client: docker.DockerClient, tmp_path: Path) -> None:
    """Idempotence: the engine already has the image, so nothing is read (not even the tarball) or replaced."""
    before = client.api.inspect_image(DEFAULT_IMAGE)["Id"]
    messages: list[str] = []
    result = import_image(engine, tmp_path / "never-read.tar", DEFAULT_IMAGE, messages.append)
    assert result.skipped
    assert result.image_id == before
    assert client.api.inspect_image(DEFAULT_IMAGE)["Id"] == before
    assert any("skipped" in message for message in messages), messages


def test_ensure_image_builds_nothing_when_present(engines: list[str], tmp_path: Path) -> None:
    """No debootstrap and no tarball needed when every engine has the image (an empty cache dir proves it)."""
    report = ensure_image(engines, DEFAULT_IMAGE, cache_dir=tmp_path / "empty-cache")
    assert not report.built
    assert report.tarball is None
    assert [result.skipped for result in report.imports] == [True] * len(engines)
    assert not (tmp_path / "empty-cache").exists()


def test_bad_tarball_path_is_a_clear_error(engine: str, client: docker.DockerClient, tmp_path: Path) -> None:
    name = f"tangram/test-missing-tarball:{uuid.uuid4().hex[:8]}"
    missing = tmp_path / "no-such-rootfs.tar"
    with pytest.raises(ImageBuildError, match="does not exist") as caught:
        import_image(engine, missing, name)
    assert str(missing) in str(caught.value)
    with pytest.raises(docker.errors.ImageNotFound):
        client.api.inspect_image(name)


def test_corrupt_tarball_is_a_clear_error(engine: str, client: docker.DockerClient, tmp_path: Path) -> None:
    """A file that is not a tar is refused by the engine, and the refusal is reported, not swallowed."""
    name = f"tangram/test-corrupt-tarball:{uuid.uuid4().hex[:8]}"
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(b"this is not a tar archive\n" * 100)
    try:
        with pytest.raises(ImageBuildError, match="docker import"):
            import_image(engine, corrupt, name)
    finally:
        try:
            client.images.remove(name, force=True)
        except docker.errors.ImageNotFound:
            pass


def test_unreachable_engine_is_a_clear_error(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/no-such-docker.sock"
    with pytest.raises(ImageBuildError, match="cannot reach the Docker engine"):
        image_exists(url)


def test_tarball_name_and_changes() -> None:
    assert tarball_path(DEFAULT_IMAGE, "/cache") == Path("/cache/tangram_sandbox-python_bookworm.tar")
    assert "WORKDIR /workspace" in IMAGE_CHANGES
    assert 'CMD ["python3"]' in IMAGE_CHANGES
