"""``tangram doctor``'s checks of a CPU node's Docker engine: it answers, its cgroup version, the default image is
there and runs. They open the engine as the broker does (``managers/cpu/sandbox_backends.py``: its TLS settings), each
call bounded by a timeout, so a dead engine is a FAIL line rather than a hang."""

from __future__ import annotations

from typing import Any

import docker
import docker.errors

from managers.cpu.config import CpuConfig, CpuNodeConfig
from managers.cpu.sandbox_backends import engine_tls
from tangram.doctor import CheckResult

#: how long one call to an engine may take; a container's run gets ``RUN_TIMEOUT_S``
ENGINE_TIMEOUT_S = 5
RUN_TIMEOUT_S = 60
PROBE = ["python3", "-c", "print('ok')"]


def check_node(node: CpuNodeConfig, cpu: CpuConfig) -> list[CheckResult]:
    """Engine, cgroup version, default image and a throwaway run of it on one ``backend = "docker"`` node."""
    prefix = f"node {node.name}"
    names = [f"{prefix}: engine", f"{prefix}: cgroup", f"{prefix}: image", f"{prefix}: runnable"]
    if node.agent:
        return [CheckResult.skip(name, "behind its node agent: the agent opens the engine on its Ray node")
                for name in names]
    try:
        client = docker.DockerClient(base_url=node.engine, tls=engine_tls(node) or False, timeout=ENGINE_TIMEOUT_S)
        client.ping()
    except Exception as error:  # noqa: BLE001 - the SDK raises several families for an unreachable engine
        return [CheckResult.fail(names[0], f"{node.engine} does not answer: {error}",
                                 f"start the Docker engine at {node.engine}, or correct cpu.nodes.{node.name}.engine "
                                 f"(and its tls_* files)"),
                *(CheckResult.skip(name, "the engine does not answer") for name in names[1:])]
    try:
        return [CheckResult.ok(names[0], f"{node.engine} answers"), _cgroup(names[1], client),
                *_image(names[2:], client, node, cpu)]
    finally:
        client.close()


def _cgroup(name: str, client: docker.DockerClient) -> CheckResult:
    info: dict[str, Any] = client.info()
    version = info.get("CgroupVersion")
    if version is None:
        return CheckResult.fail(name, "the engine reports no CgroupVersion",
                                "run a Docker engine of version 20.10 or later")
    return CheckResult.ok(name, f"cgroup v{version} ({info.get('CgroupDriver', 'unknown')} driver)")


def _image(names: list[str], client: docker.DockerClient, node: CpuNodeConfig, cpu: CpuConfig) -> list[CheckResult]:
    """The default image is present and runs python3 (other images borrow its python3) with no network and no
    capabilities, as sandboxes run."""
    image = cpu.default_image
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return [CheckResult.fail(names[0], f"{image!r} (cpu.default_image) is not on {node.engine}",
                                 f"tangram image build --name {image} --engine {node.engine}"),
                CheckResult.skip(names[1], "the image is missing")]
    present = CheckResult.ok(names[0], f"{image!r} present")
    container = None
    try:
        container = client.containers.run(image, PROBE, detach=True, network_mode="none", cap_drop=["ALL"],
                                           runtime=node.runtime)
        status = container.wait(timeout=RUN_TIMEOUT_S)
        output = container.logs().decode(errors="replace").strip()
    except Exception as error:  # noqa: BLE001 - a runtime, an image or the engine may refuse the container
        return [present, CheckResult.fail(names[1], f"a container of {image!r} did not run: {error}",
                                          f"tangram image build --name {image} --engine {node.engine} --rebuild")]
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except docker.errors.DockerException:
                pass  # the check's answer stands; the engine's own error was about removal only
    if status.get("StatusCode") != 0 or output != "ok":
        return [present, CheckResult.fail(names[1], f"python3 in {image!r} exited {status.get('StatusCode')}: "
                                                    f"{output[-200:]!r}",
                                          f"tangram image build --name {image} --engine {node.engine} --rebuild "
                                          f"(the default image needs python3)")]
    return [present, CheckResult.ok(names[1], "python3 runs with no network and no capabilities")]
