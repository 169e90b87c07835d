"""Images on demand (issue 38 item 5): an image a node lacks is pulled once per node however many environments ask
for it, with the configured credentials and a clear error when the registry has no such image or refuses; nodes
holding an image are preferred; warm pools per (image, memory); pre-pulls at node start. The engines pull from a
registry of our own on 127.0.0.1 (``tests/local_registry.py``) and nothing else."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import orjson
import pytest
import pytest_asyncio

from managers.cpu.config import CpuNodeConfig, parse_cpu_config
from managers.cpu.manager import CpuManager
from managers.cpu.node import CpuNode
from sandboxes.backend import LABEL_WARM, SandboxError
from sandboxes.image import DEFAULT_IMAGE
from sandboxes.image_pull import ImagePuller, PullPolicy, pull_refused, registry_of, with_tag
from tangram.core.action import Action, Demand, Kind
from tangram.core.errors import ConfigError
from tangram.sim.broker_station import NoSandboxes
from tests.docker_nodes import cpu_config, docker_engines, labelled_containers
from tests.harness import Live, live_broker, until
from tests.local_registry import LocalRegistry, SavedImage

PASSWORD = "s3cret-Pa55word"
TOKEN = "t0ken-for-the-test-registry"


# -- the parts alone ---------------------------------------------------------------------------------------------

def test_references_name_their_registry_as_docker_reads_them() -> None:
    assert registry_of("python:3.11") == registry_of("library/python") == "docker.io"
    assert registry_of("127.0.0.1:5000/a/b:t") == "127.0.0.1:5000"
    assert registry_of("ghcr.io/x/y") == "ghcr.io" and registry_of("localhost/x") == "localhost"
    assert with_tag("127.0.0.1:5000/a/b") == "127.0.0.1:5000/a/b:latest"
    assert with_tag("a/b:t") == "a/b:t" and with_tag("a@sha256:" + "0" * 64) == "a@sha256:" + "0" * 64
    policy = PullPolicy(allowed=("127.0.0.1", "ghcr.io:443"))
    assert policy.allows("127.0.0.1:5000") and policy.allows("127.0.0.1") and policy.allows("ghcr.io:443")
    assert not policy.allows("docker.io") and not policy.allows("ghcr.io") and PullPolicy().allows("docker.io")


def test_the_engines_refusals_become_codes_a_client_can_act_on() -> None:
    assert pull_refused("e", "i", "manifest unknown").code == "image_not_found"
    assert pull_refused("e", "i", "pull access denied for i, repository does not exist").code == "image_not_found"
    denied = pull_refused("e", "127.0.0.1:9/i", 'Head "http://127.0.0.1:9/v2/i/manifests/t": no basic auth '
                                                'credentials')
    assert denied.code == "image_pull_denied" and '[cpu.images.registries."127.0.0.1:9"]' in denied.message
    assert pull_refused("e", "i", "unauthorized").code == "image_pull_denied"
    assert pull_refused("e", "i", "dial tcp 127.0.0.1:9: connection refused").code == "image_pull_failed"


async def test_one_pull_per_image_at_most_concurrency_at_once_and_a_failure_reaches_every_waiter() -> None:
    calls: list[str] = []
    running = 0
    most = 0

    async def pull(image: str, auth: Any) -> None:
        nonlocal running, most
        calls.append(image)
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        running -= 1
        if image.endswith("bad"):
            raise SandboxError("image_not_found", f"no {image}")

    puller = ImagePuller("e", PullPolicy(concurrency=2), pull)
    results = await asyncio.gather(*(puller.pull(f"r/{name}") for name in ["a"] * 20 + ["b"] * 5 + ["c", "bad"] * 5),
                                   return_exceptions=True)
    assert sorted(calls) == ["r/a", "r/b", "r/bad", "r/c"] and most == 2 and puller.pulled == 3
    failures = [r for r in results if isinstance(r, SandboxError)]
    assert len(failures) == 5 and {f.code for f in failures} == {"image_not_found"}
    with pytest.raises(SandboxError):  # a failed pull is not remembered: asking again pulls again
        await puller.pull("r/bad")
    assert calls.count("r/bad") == 2 and puller.running == 0


async def test_a_slow_pull_times_its_waiters_out_and_goes_on_for_later_ones() -> None:
    calls = 0
    release = asyncio.Event()

    async def pull(image: str, auth: Any) -> None:
        nonlocal calls
        calls += 1
        await release.wait()

    puller = ImagePuller("e", PullPolicy(timeout_s=0.05), pull)
    with pytest.raises(SandboxError) as timed_out:
        await puller.pull("r/slow")
    assert timed_out.value.code == "image_pull_timeout"
    later = asyncio.ensure_future(puller.pull("r/slow"))
    await asyncio.sleep(0.01)
    release.set()
    await later
    assert calls == 1


async def test_a_registry_outside_pull_from_is_never_asked() -> None:
    async def pull(image: str, auth: Any) -> None:
        raise AssertionError("pulled")

    puller = ImagePuller("e", PullPolicy(allowed=("127.0.0.1",)), pull)
    with pytest.raises(SandboxError) as refused:
        await puller.pull("registry.example:5000/x/y:t")
    assert refused.value.code == "image_not_found" and "pull_from" in refused.value.message
    with pytest.raises(SandboxError) as refused:
        await puller.pull("sha256:" + "0" * 64)  # an image id (a fork's snapshot) has no registry
    assert refused.value.code == "image_not_found"


def test_registry_credentials_are_checked_and_never_shown() -> None:
    config = parse_cpu_config({"images": {"registries": {"127.0.0.1:5000": {"username": "u", "password": PASSWORD},
                                                         "ghcr.io": {"token": TOKEN}}}})
    assert PASSWORD not in repr(config) and TOKEN not in repr(config)
    policy = config.images.policy()
    assert policy is not None and PASSWORD not in repr(policy)
    assert policy.logins["ghcr.io"] == {"registrytoken": TOKEN}
    for login in ({"username": "u"}, {"token": TOKEN, "username": "u"}, {}):
        with pytest.raises(ConfigError, match="username and password, or token"):
            parse_cpu_config({"images": {"registries": {"h": login}}})
    assert parse_cpu_config({"images": {"pull": False}}).images.policy() is None


class Holding(NoSandboxes):
    """A node that holds the images it names."""

    def __init__(self, *images: str) -> None:
        self.images = images

    def holds_image(self, image: str) -> bool:
        return image in self.images


def test_node_choice_prefers_a_node_holding_the_image_within_the_locality() -> None:
    def choose(image: str, reserved_a_mb: int, locality: float = 0.5) -> str:
        manager = CpuManager(parse_cpu_config({"images": {"locality": locality}}))
        for name, backend in (("a", Holding("img:1")), ("b", Holding())):
            manager.nodes[name] = CpuNode(CpuNodeConfig(name=name, cores=(0, 1), memory_mb=1000), backend)
        manager.nodes["a"].memory_reserved = reserved_a_mb
        action = Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.fixed(1)}, trajectory="x",
                        spec={"command": "true", "memory_mb": 100, "image": image})
        fit = manager.fit()
        assert fit.try_add(action, {"cpu": 1})
        return fit.pool_of(action, "cpu")

    assert choose("img:1", 300) == "a"  # 40% load holding it beats 10% and a pull
    assert choose("img:1", 700) == "b"  # 80% is more than a pull is worth (locality 0.5)
    assert choose("img:1", 300, locality=0) == "b"  # memory balance alone
    assert choose("img:2", 300) == "b"  # neither holds it


# -- on the real engines -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_image(tmp_path_factory: pytest.TempPathFactory) -> SavedImage:
    """The default sandbox image, as a registry serves it."""
    return SavedImage.export(docker_engines()[0], DEFAULT_IMAGE, tmp_path_factory.mktemp("saved-image"))


@pytest_asyncio.fixture
async def registry(saved_image: SavedImage) -> AsyncIterator[LocalRegistry]:
    """A registry on 127.0.0.1 serving the image as one repository named for this test."""
    served = await LocalRegistry(saved_image, names={f"tangram/pulled-{uuid.uuid4().hex[:8]}"}).start()
    try:
        yield served
    finally:
        await served.stop()


@pytest.fixture
def pulled() -> Iterator[list[str]]:
    """Image references the test makes the engines pull: removed from both at its end (other tests count
    images)."""
    references: list[str] = []
    yield references
    for engine in docker_engines():
        client = docker.DockerClient(base_url=engine)
        try:
            for reference in references:
                try:
                    client.images.remove(reference, force=True)
                except docker.errors.NotFound:
                    pass
        finally:
            client.close()


def reference(registry: LocalRegistry, pulled: list[str], tag: str = "t1", name: str | None = None) -> str:
    image = f"{registry.host}/{name or next(iter(registry.names))}:{tag}"
    pulled.append(image)
    return image


def two_nodes(**cpu: Any) -> dict[str, Any]:
    first, second = docker_engines()[:2]
    return cpu_config({"a": {"backend": "docker", "engine": first, "cores": "0", "memory_mb": 4096},
                       "b": {"backend": "docker", "engine": second, "cores": "1", "memory_mb": 4096}},
                      default_memory_mb=128, **cpu)


def exec_action(image: str, trajectory: str, **spec: Any) -> dict[str, Any]:
    return {"task": "t", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": "echo ran", "image": image, **spec}}


async def run(live: Live, body: dict[str, Any]) -> dict[str, Any]:
    status, record = await live.call("POST", "/v1/actions?wait=true", json=body)
    assert status == 200, record
    return record


def engine_holds(engine: str, image: str) -> bool:
    client = docker.DockerClient(base_url=engine)
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def engine_pull(engine: str, image: str) -> None:
    client = docker.DockerClient(base_url=engine)
    try:
        client.images.pull(image)
    finally:
        client.close()


async def pulls_done(live: Live) -> dict[str, int]:
    _, body = await live.call("GET", "/v1/resources")
    return {row["pool"]: row["image_pulls"]["done"] for row in body["resources"] if row["resource"] == "cpu"}


@pytest.mark.slow
async def test_a_burst_on_a_missing_image_pulls_it_once_per_node_with_the_credentials(
        tmp_path: Path, registry: LocalRegistry, pulled: list[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    registry.basic = ("tangram", PASSWORD)
    image = reference(registry, pulled)
    config = two_nodes(images={"registries": {registry.host: {"username": "tangram", "password": PASSWORD}}})
    async with live_broker(config, str(tmp_path / "t.db")) as live:
        records = await asyncio.gather(*(run(live, exec_action(image, f"burst-{i}")) for i in range(16)))
        assert [r["state"] for r in records] == ["succeeded"] * 16, [r.get("error") for r in records]
        assert {r["result"]["node"] for r in records} == {"a", "b"}
        assert await pulls_done(live) == {"a": 1, "b": 1}
        assert all(PASSWORD not in orjson.dumps(r).decode() for r in records)
    assert registry.manifest_requests[(next(iter(registry.names)), "t1")] == 2  # one pull per engine
    assert all(engine_holds(engine, image) for engine in docker_engines())
    assert PASSWORD not in caplog.text


@pytest.mark.slow
async def test_an_image_the_registry_lacks_or_refuses_fails_with_its_code(
        tmp_path: Path, registry: LocalRegistry, pulled: list[str]) -> None:
    missing = reference(registry, pulled, name="tangram/never-pushed")
    async with live_broker(two_nodes(), str(tmp_path / "t.db")) as live:
        record = await run(live, exec_action(missing, "missing"))
        assert record["state"] == "failed" and record["error"]["code"] == "image_not_found", record
        assert "manifest unknown" in record["error"]["message"] and missing in record["error"]["message"]
        status, body = await live.call("POST", "/v1/environments", json={"task": "t", "image": missing})
        assert (status, body["error"]["code"]) == (422, "image_not_found"), body
        unreachable = await run(live, exec_action("127.0.0.1:1/tangram/nowhere:t1", "unreachable"))
        assert unreachable["error"]["code"] == "image_pull_failed", unreachable

        registry.basic = ("tangram", PASSWORD)  # the registry now wants credentials this broker has not
        image = reference(registry, pulled)
        record = await run(live, exec_action(image, "no-credentials"))
        assert record["state"] == "failed" and record["error"]["code"] == "image_pull_denied", record
        assert registry.host in record["error"]["message"]
    wrong = two_nodes(images={"registries": {registry.host: {"username": "tangram", "password": "wrong"}}})
    async with live_broker(wrong, str(tmp_path / "t.db")) as live:
        status, body = await live.call("POST", "/v1/environments", json={"task": "t", "image": image})
        assert (status, body["error"]["code"]) == (422, "image_pull_denied"), body
        assert "wrong" not in body["error"]["reason"]
    assert registry.refused >= 2 and not any(engine_holds(engine, image) for engine in docker_engines())


@pytest.mark.slow
async def test_without_pulling_a_missing_image_is_not_found_and_the_registry_never_asked(
        tmp_path: Path, registry: LocalRegistry, pulled: list[str]) -> None:
    image = reference(registry, pulled)
    for images in ({"pull": False}, {"pull_from": ["127.0.0.2"]}):
        async with live_broker(two_nodes(images=images), str(tmp_path / "t.db")) as live:
            status, body = await live.call("POST", "/v1/environments", json={"task": "t", "image": image})
            assert (status, body["error"]["code"]) == (422, "image_not_found"), body
            status, body = await live.call("POST", "/v1/images/pull", json={"task": "t", "images": [image]})
            expected = {"a": "not_pulling", "b": "not_pulling"} if images == {"pull": False} else \
                {"a": "pulling", "b": "pulling"}  # a pull that the allow-list refuses, in the background
            assert (status, body["nodes"]) == (202, expected), body
    assert not registry.manifest_requests


@pytest.mark.slow
async def test_new_environments_go_to_the_node_holding_their_image(
        tmp_path: Path, registry: LocalRegistry, pulled: list[str]) -> None:
    image = reference(registry, pulled)
    first, second = docker_engines()[:2]
    await asyncio.to_thread(engine_pull, second, image)
    async with live_broker(two_nodes(), str(tmp_path / "t.db")) as live:
        for i in range(3):
            status, env = await live.call("POST", "/v1/environments", json={"task": "t", "image": image})
            assert (status, env["node"]) == (201, "b"), env
        record = await run(live, exec_action(image, "held"))
        assert record["result"]["node"] == "b", record
        plain = await run(live, exec_action(DEFAULT_IMAGE, "plain"))  # memory balance for an image both hold
        assert plain["result"]["node"] == "a", plain
        assert await pulls_done(live) == {"a": 0, "b": 0}
    assert not engine_holds(first, image)


@pytest.mark.slow
async def test_warm_pools_per_image_and_memory_and_pre_pulls(
        tmp_path: Path, registry: LocalRegistry, pulled: list[str]) -> None:
    registry.token = TOKEN
    image = reference(registry, pulled)
    engine = docker_engines()[0]
    raw = cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 4096}},
                     images={"registries": {registry.host: {"token": TOKEN}}, "pre_pull": [image],
                             "warm_pools": [{"image": image, "memory_mb": 256, "size": 1}]})
    broker_id = raw["cpu"]["broker_id"]
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        async def pool_full() -> bool:
            _, body = await live.call("GET", "/v1/resources")
            [row] = [r for r in body["resources"] if r["resource"] == "cpu"]
            return bool(row["warm_pools"] == [{"image": image, "memory_mb": 256, "size": 1, "idle": 1}])

        assert await until(lambda: engine_holds(engine, image))  # pre-pulled at start
        await until(pool_full)
        warm = {c.short_id for c in labelled_containers(engine, broker_id) if c.labels.get(LABEL_WARM) == "1"}
        claimed = await run(live, exec_action(image, "warm", memory_mb=256))
        other = await run(live, exec_action(image, "other-memory", memory_mb=512))
        for record in (claimed, other):
            assert record["state"] == "succeeded", record
        envs = {}
        for record in (claimed, other):
            _, envs[record["id"]] = await live.call("GET", f"/v1/environments/{record['result']['environment']}")
        assert envs[claimed["id"]]["sandbox"]["container"] in warm
        assert envs[other["id"]]["sandbox"]["container"] not in warm  # no pool of 512 MiB
        assert registry.manifest_requests[(next(iter(registry.names)), "t1")] == 1



@pytest.mark.slow
async def test_a_task_asks_every_node_to_pull_its_images_ahead(
        tmp_path: Path, registry: LocalRegistry, pulled: list[str]) -> None:
    image = reference(registry, pulled)
    async with live_broker(two_nodes(), str(tmp_path / "t.db")) as live:
        status, body = await live.call("POST", "/v1/images/pull", json={"task": "t", "images": [image, image]})
        assert (status, body) == (202, {"task": "t", "images": [image], "nodes": {"a": "pulling", "b": "pulling"}})
        status, body = await live.call("POST", "/v1/images/pull", json={"task": "t", "images": ["Not A/Ref"]})
        assert (status, body["error"]["field"]) == (400, "images[0]"), body
        await until(lambda: all(engine_holds(engine, image) for engine in docker_engines()))
        records = await asyncio.gather(*(run(live, exec_action(image, f"ahead-{i}")) for i in range(4)))
        assert all(r["state"] == "succeeded" for r in records), records
        assert await pulls_done(live) == {"a": 1, "b": 1}
    assert registry.manifest_requests[(next(iter(registry.names)), "t1")] == 2
