"""Reward services added at runtime by ``POST /v1/admin/reload`` (issue 18: admission at service registration): a
real broker started from a TOML file, the real all-MiniLM-L6-v2 model in the torch worker on CPU virtual GPUs.
What fits is admitted and prepared while the broker serves; what does not is refused naming the field, and
nothing already admitted changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tangram.server.auth import new_token, token_sha256
from tests.harness import Live, broker_from_file, until
from tests.test_gpu_manager import MODEL, reward, similarities_of_pairs

ADMIN = new_token()


async def call(live: Live, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    """As the admin (the admin API exists only while auth is on)."""
    return await live.call(method, path, headers={"Authorization": f"Bearer {ADMIN}"}, **kwargs)


def write_config(path: Path, services: dict[str, dict[str, Any]], gpus: int = 2) -> None:
    """One node of ``gpus`` CPU virtual GPUs with host memory for two 100 MiB copies, and ``services``."""
    lines = [f'[store]\nurl = "sqlite+aiosqlite:///{path.parent / "tangram.db"}"\n[cpu]\nenabled = false\n',
             f'[auth]\nadmin_token_sha256 = "{token_sha256(ADMIN)}"\n',
             f"[gpu.nodes.n0]\ngpus = {gpus}\ngpu_memory_mb = 150\nhost_memory_mb = 250\ndevice_type = \"cpu\"\n"]
    for name, settings in services.items():
        body = {"backend": "torch", "model": MODEL, "task": "similarity", "dops": [1], "gpu_memory_mb": 100,
                "host_memory_mb": 100, **settings}
        lines.append(f"[gpu.services.{name}]\n" + "".join(
            f"{key} = {value}\n" if isinstance(value, (int, list)) else f'{key} = "{value}"\n'
            for key, value in body.items()))
    path.write_text("".join(lines))


async def service_states(live: Live) -> dict[str, str]:
    return {s["name"]: s["state"] for s in (await call(live, "GET", "/v1/services"))[1]["services"]}


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_a_service_added_by_reload_is_prepared_then_served_and_one_that_does_not_fit_is_refused(tmp_path):
    path = tmp_path / "tangram.toml"
    write_config(path, {"a": {}})
    async with broker_from_file(path) as live:
        write_config(path, {"a": {}, "b": {}})
        code, reply = await call(live, "POST", "/v1/admin/reload")
        assert code == 200 and reply["added_services"] == ["b"], reply
        code, early = await call(live, "POST", "/v1/actions", json=reward("b"))
        assert code in (201, 503), early  # 503 while its instances are prepared, naming the service
        if code == 503:
            assert early["error"]["field"] == "spec.service" and "preparing" in early["error"]["reason"]
        assert await until(lambda: _serving(live, "b"), timeout_s=120)
        status, record = await call(live, "POST", "/v1/actions?wait=true&timeout_s=120", json=reward("b"))
        assert status == 200 and record["state"] == "succeeded", record
        assert record["result"]["scores"] == pytest.approx(similarities_of_pairs(), abs=1e-5)

        write_config(path, {"a": {}, "b": {}, "c": {}})  # a third 100 MiB copy: over the 250 MiB of host memory
        code, reply = await call(live, "POST", "/v1/admin/reload")
        assert code == 422 and reply["error"]["field"] == "gpu.services.c.host_memory_mb", reply
        assert "admission refused" in reply["error"]["reason"] and "nothing was reloaded" in reply["error"]["reason"]
        assert await service_states(live) == {"a": "serving", "b": "serving"}
        code, reply = await call(live, "POST", "/v1/actions", json=reward("c"))
        assert code == 404 and reply["error"]["field"] == "spec.service"


async def _serving(live: Live, name: str) -> bool:
    return (await service_states(live)).get(name) == "serving"


@pytest.mark.parametrize(("change", "field"), [
    (lambda path: write_config(path, {"a": {"dops": [1, 2]}}), "gpu.services.a"),  # a running service changed
    (lambda path: write_config(path, {}), "gpu.services.a"),  # removed
    (lambda path: write_config(path, {"a": {}}, gpus=1), "gpu.nodes.n0"),  # a node resized
])
async def test_what_a_reload_cannot_change_is_refused_naming_it_and_nothing_changes(tmp_path, change, field):
    path = tmp_path / "tangram.toml"
    write_config(path, {"a": {}})
    async with broker_from_file(path) as live:
        change(path)
        code, reply = await call(live, "POST", "/v1/admin/reload")
        assert code == 409 and reply["error"]["field"] == field and "restart" in reply["error"]["reason"], reply
        assert await service_states(live) == {"a": "serving"}
        status, record = await call(live, "POST", "/v1/actions?wait=true&timeout_s=120", json=reward("a"))
        assert status == 200 and record["state"] == "succeeded", record


async def test_a_service_whose_preparation_fails_stays_unserved_with_the_reason(tmp_path):
    path = tmp_path / "tangram.toml"
    write_config(path, {"a": {}})
    async with broker_from_file(path) as live:
        write_config(path, {"a": {}, "x": {"model": str(tmp_path / "no-such-model")}})
        code, reply = await call(live, "POST", "/v1/admin/reload")
        assert code == 200 and reply["added_services"] == ["x"], reply
        state = await until(lambda: _failed(live, "x"), timeout_s=60)
        assert "gpu.services.x" in state and "no-such-model" in state
        code, reply = await call(live, "POST", "/v1/actions", json=reward("x"))
        assert code == 503 and reply["error"]["field"] == "spec.service" and "failed" in reply["error"]["reason"]
        status, record = await call(live, "POST", "/v1/actions?wait=true&timeout_s=120", json=reward("a"))
        assert status == 200 and record["state"] == "succeeded", record


async def _failed(live: Live, name: str) -> str | None:
    state = (await service_states(live)).get(name, "")
    return state if state.startswith("failed") else None
