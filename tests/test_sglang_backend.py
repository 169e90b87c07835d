"""The SGLang backend against real server processes on loopback: the stand-in (``tests/sglang_standin.py``).

Each test launches stand-in servers through the backend exactly as it launches ``sglang.launch_server`` (only the
command prefix differs), reads device memory from the stand-in's memory file as a probe reads the driver, and
checks that no process outlives it.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import pytest_asyncio

from reward_services.backend import ServiceError, ServiceSpec, Task
from reward_services.options import SglangOptions
from reward_services.sglang import SglangBackend, SglangInstance, free_port, launch_command, launch_env
from tests.sglang_standin import fake_completion, fake_embedding, fake_label_probs, fake_reward

REPO_ROOT = Path(__file__).resolve().parent.parent
STANDIN = [sys.executable, "-m", "tests.sglang_standin"]
GPU_MEMORY_MB = 1000  # what each stand-in loads per device (STANDIN_GPU_MEMORY_MB)
CONTEXT_MB = 100  # what it holds while it runs, released or not (STANDIN_CONTEXT_MB)
SpecMaker = Callable[..., ServiceSpec]


class StandinProbe:
    """Device memory from the stand-in's memory file, counting live processes only, as the driver would."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def used_mb(self, device: int) -> int:
        try:
            with open(self.path) as file:
                fcntl.flock(file, fcntl.LOCK_SH)  # the stand-in rewrites it under LOCK_EX
                text = file.read()
        except FileNotFoundError:
            return 0
        table = json.loads(text) if text.strip() else {}
        return sum(usage.get(str(device), 0) for pid, usage in table.items() if alive(int(pid)))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(group: int) -> list[int]:
    """Live processes of a server's process group: the server and its subprocesses (SGLang's scheduler)."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


@pytest.fixture
def memory_file(tmp_path: Path) -> Path:
    return tmp_path / "gpu-memory.json"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


@pytest_asyncio.fixture
async def backend(tmp_path: Path, memory_file: Path) -> AsyncIterator[SglangBackend]:
    made = SglangBackend(tmp_path / "logs", StandinProbe(memory_file))
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
def make_spec(model_dir: Path, memory_file: Path) -> SpecMaker:
    """Specs launching the stand-in from the repository root, publishing its memory to ``memory_file``."""

    def make(task: Task, *, env: dict[str, str] | None = None, model: str | None = None,
             **options: Any) -> ServiceSpec:
        standin_env = {"STANDIN_MEMORY_FILE": str(memory_file), "STANDIN_GPU_MEMORY_MB": str(GPU_MEMORY_MB),
                       "STANDIN_CONTEXT_MB": str(CONTEXT_MB), "STANDIN_START_DELAY_S": "0.05",
                       "STANDIN_RELEASE_DELAY_S": "0.1", **(env or {})}
        return ServiceSpec(name=f"rm-{task}", backend="sglang", model=model or str(model_dir), task=task,
                           dops=(1, 2), gpu_memory_mb=GPU_MEMORY_MB, host_memory_mb=2000,
                           options=SglangOptions(**{"command": STANDIN, "cwd": str(REPO_ROOT), "env": standin_env,
                                                    "start_timeout_s": 30, "release_timeout_s": 10,
                                                    "request_timeout_s": 10, **options}))

    return make


@asynccontextmanager
async def prepared(backend: SglangBackend, spec: ServiceSpec,
                   devices: tuple[int, ...]) -> AsyncIterator[SglangInstance]:
    """A prepared instance, closed at the end; asserts that nothing of its server survives the close."""
    instance = backend.instance(spec, devices)
    await instance.prepare()
    assert instance.process is not None
    group = instance.process.pid
    try:
        yield instance
    finally:
        await instance.close()
        assert group_members(group) == []


REQUESTS: dict[str, dict[str, Any]] = {
    "classify": {"texts": ["a fine answer", "a poor answer", ""]},
    "score": {"query": "Is 2 + 2 = 4? Answer:", "items": [" yes", " no"], "label_token_ids": [9454, 2753]},
    "generate": {"prompts": ["Judge: the sky is green.", "Judge: 1 + 1 = 2."],
                 "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}},
    "similarity": {"pairs": [["the cat sat", "a cat sat"], ["same words", "same words"]]},
}


def expected(task: str) -> dict[str, Any]:
    request = REQUESTS[task]
    if task == "classify":
        return {"scores": [fake_reward(text) for text in request["texts"]]}
    if task == "score":
        return {"scores": [fake_label_probs(request["query"], item, request["label_token_ids"])
                           for item in request["items"]]}
    if task == "generate":
        return {"texts": [fake_completion(prompt, 12) for prompt in request["prompts"]]}
    return {"scores": [cosine(fake_embedding(a), fake_embedding(b)) for a, b in request["pairs"]]}


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def assert_results(task: str, result: dict[str, Any]) -> None:
    want = expected(task)
    assert result.keys() == want.keys()
    if task == "similarity":  # cosines computed two ways; the rest must come back exactly as the server sent them
        assert result["scores"] == pytest.approx(want["scores"])
        assert result["scores"][1] == pytest.approx(1.0)
    else:
        assert result == want


def test_launch_command_for_dop2_on_gpus_2_and_3() -> None:
    tail = ["--tp-size", "2", "--host", "127.0.0.1", "--port", "31000", "--enable-memory-saver",
            "--enable-weights-cpu-backup"]
    reward = ServiceSpec(name="rm", backend="sglang", model="/models/rm", task="classify", dops=(2,),
                         gpu_memory_mb=1, host_memory_mb=1)
    assert launch_command(reward, (2, 3), 31000, SglangOptions()) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/models/rm", *tail, "--is-embedding"]
    judge = ServiceSpec(name="judge", backend="sglang", model="Qwen/Qwen2.5-7B-Instruct", task="generate", dops=(2,),
                        gpu_memory_mb=1, host_memory_mb=1, options=SglangOptions(args=("--mem-fraction-static", "0.8")))
    assert launch_command(judge, (2, 3), 31000, SglangOptions(args=("--mem-fraction-static", "0.8"))) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B-Instruct", *tail,
        "--mem-fraction-static", "0.8"]
    env = launch_env((2, 3), SglangOptions(env={"HF_HOME": "/cache"}))
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"], env["HF_HOME"]) == ("2,3", "PCI_BUS_ID", "/cache")


@pytest.mark.parametrize("task", ["classify", "similarity", "score", "generate"])
async def test_prepared_server_runs_that_argv_and_env_and_holds_no_device_memory(
        task: str, backend: SglangBackend, make_spec: SpecMaker, memory_file: Path) -> None:
    spec = make_spec(task)
    async with prepared(backend, spec, (2, 3)) as instance:
        assert instance.process is not None
        server = psutil.Process(instance.process.pid)
        assert instance.port is not None
        assert server.cmdline() == launch_command(spec, (2, 3), instance.port, instance.options)
        assert ("--is-embedding" in server.cmdline()) == (task in ("classify", "similarity"))
        environ = server.environ()
        assert (environ["CUDA_VISIBLE_DEVICES"], environ["CUDA_DEVICE_ORDER"]) == ("2,3", "PCI_BUS_ID")
        probe = StandinProbe(memory_file)
        assert [probe.used_mb(device) for device in (1, 2, 3, 4)] == [0, CONTEXT_MB, CONTEXT_MB, 0]
        assert instance.describe() == {"url": f"http://127.0.0.1:{instance.port}", "pid": server.pid,
                                       "port": instance.port, "log": str(instance.log_path)}


@pytest.mark.parametrize("task", ["classify", "similarity", "score", "generate"])
async def test_restore_infer_evict_restore_infer(task: str, backend: SglangBackend, make_spec: SpecMaker,
                                                 memory_file: Path) -> None:
    probe = StandinProbe(memory_file)
    async with prepared(backend, make_spec(task), (0,)) as instance:
        await instance.restore()
        assert probe.used_mb(0) == CONTEXT_MB + GPU_MEMORY_MB
        assert_results(task, await instance.infer(REQUESTS[task]))
        await instance.restore()  # already resident: no second resume (it would take SGLang down)
        assert_results(task, await instance.infer(REQUESTS[task]))
        await instance.evict()
        assert probe.used_mb(0) == CONTEXT_MB
        await instance.restore()
        assert_results(task, await instance.infer(REQUESTS[task]))


async def test_evict_returns_only_once_the_driver_shows_the_memory_free(
        backend: SglangBackend, make_spec: SpecMaker, memory_file: Path) -> None:
    delay_s = 0.5
    probe = StandinProbe(memory_file)
    spec = make_spec("classify", env={"STANDIN_RELEASE_DELAY_S": str(delay_s)})
    async with prepared(backend, spec, (4, 5)) as instance:
        await instance.restore()
        assert [probe.used_mb(4), probe.used_mb(5)] == [CONTEXT_MB + GPU_MEMORY_MB] * 2
        started = time.monotonic()
        await instance.evict()
        assert time.monotonic() - started >= delay_s
        assert [probe.used_mb(4), probe.used_mb(5)] == [CONTEXT_MB] * 2
        with pytest.raises(ServiceError) as refused:  # the stand-in refuses inference on released memory
            await instance.infer(REQUESTS["classify"])
        assert refused.value.code == "inference_failed"


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_evict_fails_when_the_memory_is_not_freed_in_time(backend: SglangBackend, make_spec: SpecMaker) -> None:
    spec = make_spec("generate", env={"STANDIN_RELEASE_DELAY_S": "1"})
    async with prepared(backend, spec, (0,)) as instance:
        await instance.restore()
        instance.options = replace(instance.options, release_timeout_s=0.3)  # shorter than the driver now takes
        with pytest.raises(ServiceError) as failed:
            await instance.evict()
        assert failed.value.code == "evict_failed"
        assert failed.value.message == ("device memory not freed 0.3 s after the release "
                                        "(GPU 0: 1100 MB in use, 1100 MB before the release)")


async def test_killed_server_is_service_unavailable(backend: SglangBackend, make_spec: SpecMaker) -> None:
    async with prepared(backend, make_spec("classify"), (0,)) as instance:
        await instance.restore()
        assert instance.process is not None
        os.kill(instance.process.pid, signal.SIGKILL)
        with pytest.raises(ServiceError) as infer_error:
            await instance.infer(REQUESTS["classify"])
        assert infer_error.value.code == "service_unavailable"
        await instance.process.wait()
        for operation in (instance.restore, instance.evict):
            with pytest.raises(ServiceError) as error:
                await operation()
            assert error.value.code == "service_unavailable"
            assert "exited with code -9" in error.value.message
    # ``prepared`` checked that close() also stopped the server's child, which SIGKILL had orphaned


async def test_input_the_server_refuses_is_bad_input(backend: SglangBackend, make_spec: SpecMaker) -> None:
    cases = (("generate", {"prompts": ["x" * 64], "sampling_params": {}},
              {"prompts": ["ok"], "sampling_params": {"max_new_tokens": 3}}),
             ("similarity", {"pairs": [["short", "y" * 64]]}, {"pairs": [["a", "a"]]}))
    for task, refused_request, fine_request in cases:  # a native endpoint's error body, then an OpenAI one's
        async with prepared(backend, make_spec(task, args=["--context-length", "32"]), (0,)) as instance:
            await instance.restore()
            with pytest.raises(ServiceError) as refused:
                await instance.infer(refused_request)
            assert refused.value.code == "bad_input"
            assert refused.value.message == ("The input (64 tokens) is longer than the model's context length "
                                             "(32 tokens).")
            assert await instance.infer(fine_request)


async def test_server_exiting_at_start_is_prepare_failed_with_its_log(backend: SglangBackend, make_spec: SpecMaker,
                                                                      tmp_path: Path) -> None:
    instance = backend.instance(make_spec("classify", model=str(tmp_path / "missing")), (0,))
    with pytest.raises(ServiceError) as failed:
        await instance.prepare()
    assert failed.value.code == "prepare_failed"
    assert "exited with code 1" in failed.value.message
    assert f"model path {tmp_path / 'missing'} is not a local directory" in failed.value.message
    assert instance.process is None


async def test_server_not_healthy_in_time_is_prepare_failed_and_stopped(backend: SglangBackend,
                                                                        make_spec: SpecMaker) -> None:
    instance = backend.instance(make_spec("classify", env={"STANDIN_START_DELAY_S": "60"}, start_timeout_s=0.5), (0,))
    preparing = asyncio.create_task(instance.prepare())
    while instance.process is None and not preparing.done():
        await asyncio.sleep(0.01)
    assert instance.process is not None
    group = instance.process.pid
    with pytest.raises(ServiceError) as failed:
        await preparing
    assert failed.value.code == "prepare_failed"
    assert "not healthy after 0.5 s" in failed.value.message
    assert instance.process is None
    assert group_members(group) == []


async def test_close_is_idempotent_and_stops_the_whole_process_group(backend: SglangBackend,
                                                                    make_spec: SpecMaker) -> None:
    instance = backend.instance(make_spec("score"), (0, 1))
    await instance.prepare()
    await instance.restore()
    assert instance.process is not None
    group = instance.process.pid
    assert len(group_members(group)) == 2  # the server and its scheduler
    await instance.close()
    await instance.close()
    assert group_members(group) == []
    with pytest.raises(ServiceError) as error:
        await instance.infer(REQUESTS["score"])
    assert error.value.code == "service_unavailable"


# ----------------------------------------------------------------------------------------------------------------
# The stand-in itself, launched directly, where it behaves as SGLang does beyond what the backend ever asks of it.
# ----------------------------------------------------------------------------------------------------------------

@asynccontextmanager
async def standin(flags: list[str], model_dir: Path, memory_file: Path) -> AsyncIterator[str]:
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "STANDIN_MEMORY_FILE": str(memory_file),
           "STANDIN_RELEASE_DELAY_S": "0"}
    process = await asyncio.create_subprocess_exec(
        *STANDIN, "--model-path", str(model_dir), "--port", str(port), *flags, cwd=REPO_ROOT, env=env,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                try:
                    async with http.get(url + "/health") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the server, or its scheduler after the server died
        await process.wait()


async def post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def test_standin_without_weights_backup_resumes_zero_weights(model_dir: Path, memory_file: Path) -> None:
    async with standin(["--enable-memory-saver", "--is-embedding"], model_dir, memory_file) as url:
        assert await post(url + "/classify", {"text": ["x"]}) == (200, [
            {"embedding": [fake_reward("x")], "meta_info": {"id": "standin-0", "prompt_tokens": 1}}])
        assert await post(url + "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}) == (200, None)
        assert await post(url + "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}) == (200, None)
        status, answer = await post(url + "/classify", {"text": ["x"]})
        assert (status, answer[0]["embedding"]) == (200, [0.0])


async def test_standin_without_memory_saver_keeps_its_memory(model_dir: Path, memory_file: Path) -> None:
    async with standin(["--enable-weights-cpu-backup"], model_dir, memory_file) as url:
        assert await post(url + "/release_memory_occupation", {"tags": ["weights"]}) == (200, None)
        await asyncio.sleep(0.1)
        assert StandinProbe(memory_file).used_mb(0) == 100 + 1000
        status, answer = await post(url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})
        assert (status, answer["text"]) == (200, fake_completion("hi", 4))


async def test_standin_refuses_what_it_does_not_serve(model_dir: Path, memory_file: Path) -> None:
    async with standin(["--enable-memory-saver"], model_dir, memory_file) as url, aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json={}) as response:
            assert response.status == 404
        async with http.get(url + "/generate") as response:
            assert response.status == 405
        async with http.post(url + "/generate", data=b"{not json") as response:
            assert (response.status, await response.json()) == (400, {"error": {"message": "malformed JSON body"}})
        async with http.post(url + "/v1/score", data=b"{}", headers={"content-type": "text/plain"}) as response:
            assert (response.status, (await response.json())["object"]) == (400, "error")
        assert (await post(url + "/release_memory_occupation", {"tags": ["weigths"]}))[0] == 400
        with pytest.raises(aiohttp.ServerDisconnectedError):  # resuming what was not released takes it down
            await post(url + "/resume_memory_occupation", {"tags": ["weights"]})


async def test_standin_rejects_unknown_flags(model_dir: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        *STANDIN, "--model-path", str(model_dir), "--no-such-flag", cwd=REPO_ROOT,
        stderr=asyncio.subprocess.PIPE)
    _, stderr = await process.communicate()
    assert process.returncode == 2
    assert b"unrecognized arguments: --no-such-flag" in stderr
