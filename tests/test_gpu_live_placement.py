"""The broker placing its reward services itself (issue 18): a real broker started from a TOML file, over real HTTP
on loopback, its GPU manager on two nodes of CPU virtual GPUs typed as an H100 node and an H20 node, with stand-in
services whose inference takes the time the type would give them (a scorer 8x slower on the H20s, a generator as
fast). The placement is solved on the manager's worker thread from the demand it measures; it shows in
``GET /v1/services`` and ``/metrics``, and confines the services' later actions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from managers.gpu.config import GpuConfig, GpuNodeConfig
from managers.gpu.manager import GpuManager
from reward_services.backend import ServiceBackend, ServiceInstance, ServiceSpec
from tangram.cli import main as cli_main
from tangram.config import Config
from tangram.core.seam import ResourceManager
from tangram.records import Resources, ServiceRecord
from tests.harness import Live, broker_from_file, until
from tests.standin_services import IdleBackend, IdleInstance

#: seconds of one inference by service and node type
INFER_S = {("a", "h100"): 0.02, ("a", "h20"): 0.16, ("g", "h100"): 0.02, ("g", "h20"): 0.02}


class TypedInstance(IdleInstance):
    def __init__(self, spec: ServiceSpec, devices: tuple[int, ...], kind: str) -> None:
        super().__init__(spec, devices)
        self.kind = kind

    async def infer(self, request: Any) -> dict[str, Any]:
        await asyncio.sleep(INFER_S[(self.spec.name, self.kind)])
        return {}


class TypedBackend(IdleBackend):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> ServiceInstance:
        return TypedInstance(spec, devices, self.kind)


def stand_ins(config: Config) -> list[ResourceManager]:
    def backend(_: str, node: GpuNodeConfig, __: GpuConfig) -> ServiceBackend:
        return TypedBackend(node.type)
    return [GpuManager(config.gpu, make_backend=backend)]


def write_config(path: Path) -> None:
    nodes = "".join(f'[gpu.nodes.{name}]\ngpus = 2\ngpu_memory_mb = 100\nhost_memory_mb = 1000\ndevice_type = "cpu"\n'
                    f'type = "{kind}"\n' for name, kind in (("fast", "h100"), ("slow", "h20")))
    services = ('[gpu.services.a]\nbackend = "torch"\nmodel = "m"\ntask = "similarity"\n'
                'gpu_memory_mb = 100\nhost_memory_mb = 100\n'
                '[gpu.services.g]\nbackend = "sglang"\nmodel = "m"\ntask = "generate"\n'
                'gpu_memory_mb = 100\nhost_memory_mb = 100\n')
    path.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{path.parent / "tangram.db"}"\n[cpu]\nenabled = false\n'
                    '[gpu.placement]\ninterval_s = 0.5\nwindow_s = 30\n' + nodes + services)


def reward(service: str) -> dict[str, Any]:
    body = {"prompts": ["x"]} if service == "g" else {"pairs": [["x", "y"]]}
    return {"task": "t", "kind": "reward", "demand": {"gpu": 1}, "spec": {"service": service, "input": body}}


async def run_all(live: Live, services: list[str]) -> list[dict[str, Any]]:
    code, batch = await live.call("POST", "/v1/actions:batch", json={"actions": [reward(s) for s in services]})
    assert code == 200, batch
    done = []
    for record in batch["actions"]:
        code, record = await live.call("GET", f"/v1/actions/{record['id']}?wait=true")
        assert code == 200 and record["state"] == "succeeded", record
        done.append(record)
    return done


async def test_the_broker_places_its_services_from_measured_demand(tmp_path: Path, capsys: Any,
                                                                   monkeypatch: Any) -> None:
    path = tmp_path / "tangram.toml"
    write_config(path)
    async with broker_from_file(path, stand_ins) as live:
        for _ in range(3):  # g asked for 8x more than a: g needs every GPU, a only the H100s' left-over
            await run_all(live, ["g"] * 16 + ["a"] * 2)

        async def placed() -> dict[str, Any] | None:
            code, body = await live.call("GET", "/v1/services")
            assert code == 200, body
            services = {s["name"]: s for s in body["services"]}
            return services if all(s["placement"]["confined"] for s in services.values()) else None

        services = await until(placed, timeout_s=30)
        for described in services.values():  # as the OpenAPI document says
            ServiceRecord.model_validate_json(json.dumps(described))
        assert services["a"]["placement"]["types"].keys() == {"h100"}
        assert services["g"]["placement"]["types"].keys() == {"h100", "h20"}
        assert services["g"]["placement"]["load"] > services["a"]["placement"]["load"] > 0
        # run times learned per type, from the actions' own executions
        for service in ("a", "g"):
            assert services[service]["run_gpu_s"].keys() <= {"h100", "h20"} and services[service]["run_gpu_s"]

        # read before more actions move the measured demand (and a solve every 0.5 s could then place g elsewhere)
        code, metrics = await live.call("GET", "/metrics")
        assert code == 200
        solves = next(line for line in metrics.splitlines() if line.startswith("tangram_gpu_placement_solves_total"))
        assert 'method="ilp"' in solves and float(solves.split()[-1]) >= 1
        for prefix in ('tangram_gpu_service_load{service="g"}', "tangram_gpu_placement_objective ",
                       'tangram_gpu_placement_share{service="a",type="h100"}',
                       'tangram_gpu_placement_share{service="g",type="h20"}', "tangram_gpu_placement_solve_seconds "):
            line = next((line for line in metrics.splitlines() if line.startswith(prefix)), None)
            assert line is not None and float(line.split()[-1]) > 0, prefix

        ran_on = {record["result"]["node"] for record in await run_all(live, ["a"] * 6)}
        assert ran_on == {"fast"}  # a is confined to the H100 node, though the H20 node is free

        code, resources = await live.call("GET", "/v1/resources")  # public status: the placement in force
        assert code == 200
        Resources.model_validate_json(json.dumps(resources))
        placement = resources["placement"]
        assert placement["method"] == "ilp" and placement["answered_by"] == "ilp" and placement["fallback"] is None
        assert placement["solves"]["ilp"] >= 1 and placement["objective"] > 0
        rows = {row["service"]: row for row in placement["services"]}
        assert rows["a"]["types"].keys() == {"h100"} and rows["a"]["confined"]

        monkeypatch.setenv("COLUMNS", "200")
        assert await asyncio.to_thread(cli_main, ["status", "--url", live.url]) == 0
        shown = capsys.readouterr().out
        assert "GPU placement (ilp): ilp, t = " in shown
        cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in shown.splitlines()]
        row = next(row for row in cells if row and row[0] == "a" and len(row) == 4)
        assert row[2].startswith("h100 ") and row[3] == "yes", shown


async def test_a_broker_on_one_gpu_type_solves_no_placement(tmp_path: Path) -> None:
    path = tmp_path / "tangram.toml"
    write_config(path)
    path.write_text(path.read_text().replace('type = "h20"', 'type = "h100"'))
    async with broker_from_file(path, stand_ins) as live:
        await run_all(live, ["a", "g"])
        code, resources = await live.call("GET", "/v1/resources")
        assert code == 200 and resources["placement"] is None
        Resources.model_validate_json(json.dumps(resources))
        code, body = await live.call("GET", "/v1/services")
        assert all("placement" not in service for service in body["services"])
        code, metrics = await live.call("GET", "/metrics")
        assert "tangram_gpu_placement" not in metrics
