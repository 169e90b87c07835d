"""SGLang reward services: one ``sglang.launch_server`` process per instance, evicted through its memory saver.

Each instance is a server launched on its chunk (``CUDA_VISIBLE_DEVICES``, ``--tp-size`` = DoP) with
``--enable-memory-saver --enable-weights-cpu-backup``: ``evict`` asks it to release its device memory (it keeps a
CPU copy of the weights in its own process, hence ``shares_host_copy = False``), ``restore`` to resume it.

SGLang facts this relies on, read in github.com/sgl-project/sglang (re-check them when upgrading SGLang):

* ``python/sglang/srt/entrypoints/http_server.py``: ``GET /health`` (same handler as ``/health_generate``) is 503
  while the server starts and 200 once a one-token generation answers. ``/release_memory_occupation`` and
  ``/resume_memory_occupation`` (GET/POST) take ``{"tags": [...]}`` and answer 200 ``null``, or 400
  ``{"error": {"message": ...}}``. ``/classify`` and ``/generate`` (POST/PUT) answer, for a list input, a list of
  ``{"embedding": [...], "meta_info": {...}}`` / ``{"text": ..., "meta_info": {...}}``, or 400
  ``{"error": {"message": ...}}`` (``ValueError`` from validation, e.g. an input over the context length).
  ``/v1/embeddings`` and ``/v1/score`` (POST, ``application/json`` only) answer OpenAI-style, or 400
  ``{"object": "error", "message": ..., "type": ..., "param": null, "code": 400}``.
* ``python/sglang/srt/managers/io_struct.py``: ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``
  carry ``tags: Optional[List[str]]`` (none = all); ``GenerateReqInput`` (``text``, ``sampling_params``) and
  ``EmbeddingReqInput`` (``text``) take a string or a list of strings.
* ``python/sglang/srt/constants.py``: the tags are ``weights``, ``kv_cache``, ``cuda_graph`` (and
  ``weights_drafter`` for speculative decoding, which reward services do not use).
* ``python/sglang/srt/managers/scheduler_update_weights_mixin.py``: release adds its tags to ``offload_tags`` and
  pauses each region; resume first ``remove``s each tag, so resuming a tag that is not released raises KeyError in
  the scheduler and takes the server down. Hence ``restore`` resumes exactly the tags ``evict`` released, once.
* ``python/sglang/srt/torch_memory_saver_adapter.py``: without ``--enable-memory-saver``, release only logs a
  warning and keeps the memory (still 200). And (a known pitfall, not visible in the source) the release answers
  before the driver shows the memory free. Hence ``evict`` watches the devices through a ``DeviceMemoryProbe``.
* ``python/sglang/srt/entrypoints/openai/protocol.py``: ``EmbeddingRequest`` (``input``) -> ``EmbeddingResponse``
  (``data[i].embedding``, ``data[i].index``); ``ScoringRequest`` (``query``, ``items``, ``label_token_ids``,
  ``apply_softmax`` default false) -> ``ScoringResponse`` (``scores``: per item, probabilities in label order).
* ``docs/advanced_features/server_arguments.md``: ``--model-path``, ``--tp-size``, ``--host``, ``--port``,
  ``--is-embedding``, ``--mem-fraction-static``, ``--enable-memory-saver``, ``--enable-weights-cpu-backup``.
  Without the last one a release drops the weights and a resume maps fresh, uninitialised memory: no error, wrong
  outputs. Reward models and embedding models run with ``--is-embedding``
  (``docs/supported_models/specialized/reward_models.md``, ``.../retrieval_ranking/embedding_models.md``);
  ``/v1/score`` needs a generative model.

``spec.options`` is a ``SglangOptions`` (``reward_services/options.py``): the command, extra flags, environment
and working directory of the server, and its start, release and request timeouts.

Without a probe ``evict`` returns as soon as the server acknowledges the release, which may be before the driver
frees the memory: use one (``NvmlProbe``) wherever another instance may be restored right after.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import numpy as np
import psutil

from reward_services.backend import ServiceBackend, ServiceError, ServiceInstance, ServiceSpec
from reward_services.options import SglangOptions, options_of

#: tasks served by a model launched with --is-embedding (reward heads and embedding models)
EMBEDDING_TASKS = frozenset({"classify", "similarity"})
#: every region the memory saver pauses for a model without a draft model (sglang/srt/constants.py)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
#: share of ``gpu_memory_mb`` that must have left each device before an eviction counts as done
RELEASED_SHARE = 0.9
HEALTH_POLL_S = 0.1
MEMORY_POLL_S = 0.05
HEALTH_CALL_TIMEOUT_S = 30.0
STOP_GRACE_S = 15.0
LOG_TAIL_BYTES = 4000
MESSAGE_CHARS = 2000


class DeviceMemoryProbe(Protocol):
    """Memory in use on a GPU of this node as the driver reports it (what nvidia-smi shows), whoever holds it."""

    def used_mb(self, device: int) -> int: ...


class NvmlProbe:
    """``DeviceMemoryProbe`` through NVML. NVML numbers GPUs in PCI bus order, so servers get the same order."""

    def __init__(self) -> None:
        import pynvml  # only GPU nodes have it

        pynvml.nvmlInit()
        self._nvml = pynvml

    def used_mb(self, device: int) -> int:
        handle = self._nvml.nvmlDeviceGetHandleByIndex(device)
        return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used) >> 20


def launch_command(spec: ServiceSpec, devices: Sequence[int], port: int, options: SglangOptions) -> list[str]:
    """The server's argv: the command prefix, our flags, then ``options.args``."""
    command = [*options.command, "--model-path", spec.model, "--tp-size", str(len(devices)), "--host", "127.0.0.1",
                "--port", str(port), "--enable-memory-saver", "--enable-weights-cpu-backup"]
    if spec.task in EMBEDDING_TASKS:
        command.append("--is-embedding")
    return command + list(options.args)


def launch_env(devices: Sequence[int], options: SglangOptions) -> dict[str, str]:
    """This process's environment, ``options.env``, and the chunk's GPUs numbered as NVML numbers them."""
    return {**os.environ, **options.env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(device) for device in devices)}


class SglangBackend(ServiceBackend):
    """Makes SGLang instances; logs each server to ``log_dir`` and shares one HTTP session among them."""

    shares_host_copy = False

    def __init__(self, log_dir: str | Path, probe: DeviceMemoryProbe | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.probe = probe
        self._session: aiohttp.ClientSession | None = None

    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> SglangInstance:
        return SglangInstance(spec, devices, self)

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class SglangInstance(ServiceInstance):
    """One server process; ``released`` says whether its memory is released (prepared) or resumed (resident)."""

    def __init__(self, spec: ServiceSpec, devices: tuple[int, ...], backend: SglangBackend) -> None:
        super().__init__(spec, devices)
        self.options = options_of(spec.name, spec.options, SglangOptions)
        self.backend = backend
        self.process: asyncio.subprocess.Process | None = None
        self.port: int | None = None
        self.log_path: Path | None = None
        self.baseline_mb: dict[int, int] = {}  # device memory used by others before the server started
        self.released = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def prepare(self) -> None:
        options = self.options
        probe = self.backend.probe
        if probe is not None:
            self.baseline_mb = {device: probe.used_mb(device) for device in self.devices}
        self.port = free_port()
        command = launch_command(self.spec, self.devices, self.port, options)
        env = launch_env(self.devices, options)
        self.backend.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.backend.log_dir / f"{self.spec.name}-gpu{'_'.join(map(str, self.devices))}-{self.port}.log"
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=options.cwd,
                start_new_session=True)  # its own process group: close() stops SGLang's subprocesses too
        except OSError as error:
            raise ServiceError("prepare_failed", f"cannot start {command[0]!r}: {error}") from None
        finally:
            os.close(log)
        try:
            await self._wait_healthy(options.start_timeout_s)
            try:
                await self._release("prepare_failed")
            except ServiceError as error:
                raise ServiceError("prepare_failed", f"{error.message}\n{self._log_tail()}") from None
        except BaseException:
            await self.close()
            raise

    async def restore(self) -> None:
        """Resume what was released (nothing if resident: a second resume would crash SGLang), then check health.

        After ``restore_failed`` the server's memory state is unknown: close the instance rather than retry.
        """
        self._require_process()
        if self.released:
            await self._request("/resume_memory_occupation", {"tags": list(MEMORY_TAGS)}, "restore_failed")
            self.released = False
        if not await self._healthy(self._request_timeout()):
            self._require_process()
            raise ServiceError("restore_failed", f"server not healthy after resuming its memory\n{self._log_tail()}")

    async def evict(self) -> None:
        self._require_process()
        await self._release("evict_failed")

    async def infer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        path, body_of, result_of = ENDPOINTS[self.spec.task]
        answer = await self._request(path, body_of(request), "inference_failed", refused_code="bad_input")
        try:
            return result_of(request, answer)
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise ServiceError("inference_failed", f"unexpected answer from {path}: {error!r}") from None

    async def close(self) -> None:
        """Stop the server's process group and return once all of it has exited (its GPU memory is then free)."""
        process, self.process = self.process, None
        if process is None:
            return
        members = _group_processes(process.pid)  # the server (the group's leader) and SGLang's subprocesses
        try:
            if process.returncode is None:
                _signal_group(process.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), STOP_GRACE_S)
                except TimeoutError:
                    pass
        finally:  # whatever is left of the group, even when the server itself is already gone
            _signal_group(process.pid, signal.SIGKILL)
        await process.wait()
        deadline = asyncio.get_running_loop().time() + STOP_GRACE_S
        while any(_running(member) for member in members) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(MEMORY_POLL_S)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url if self.port else None, "pid": self.process.pid if self.process else None,
                "port": self.port, "log": str(self.log_path) if self.log_path else None}

    async def _release(self, failure_code: str) -> None:
        """Release the device memory and return once the devices show it free (nothing to do if released)."""
        if self.released:
            return
        probe = self.backend.probe
        before = {device: probe.used_mb(device) for device in self.devices} if probe else {}
        await self._request("/release_memory_occupation", {"tags": list(MEMORY_TAGS)}, failure_code)
        self.released = True
        if probe is not None:
            await self._wait_memory_freed(probe, before, failure_code)

    async def _wait_memory_freed(self, probe: DeviceMemoryProbe, before: dict[int, int], failure_code: str) -> None:
        """Poll until every device dropped by ``RELEASED_SHARE`` of the service's memory, or to its baseline."""
        timeout = self.options.release_timeout_s
        needed = RELEASED_SHARE * self.spec.gpu_memory_mb
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            used = {device: probe.used_mb(device) for device in self.devices}
            waiting = [device for device in self.devices
                       if before[device] - used[device] < needed and used[device] > self.baseline_mb[device]]
            if not waiting:
                return
            if loop.time() >= deadline:
                detail = ", ".join(f"GPU {d}: {used[d]} MB in use, {before[d]} MB before the release" for d in waiting)
                raise ServiceError(failure_code, f"device memory not freed {timeout:g} s after the release ({detail})")
            await asyncio.sleep(MEMORY_POLL_S)

    async def _wait_healthy(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            assert self.process is not None
            if self.process.returncode is not None:
                raise ServiceError("prepare_failed", f"server exited with code {self.process.returncode} before it "
                                                     f"was healthy\n{self._log_tail()}")
            left = deadline - loop.time()
            if left <= 0:
                raise ServiceError("prepare_failed", f"server not healthy after {timeout:g} s\n{self._log_tail()}")
            if await self._healthy(min(HEALTH_CALL_TIMEOUT_S, left)):
                return
            await asyncio.sleep(HEALTH_POLL_S)

    async def _healthy(self, timeout: float) -> bool:
        try:
            async with self.backend.session.get(self.url + "/health",
                                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _request(self, path: str, body: dict[str, Any], failure_code: str,
                       refused_code: str | None = None) -> Any:
        """POST ``body``; the answer's JSON, or ``ServiceError``: ``refused_code`` when the server refuses the input
        (400/413/422), ``service_unavailable`` when it cannot be reached, ``failure_code`` otherwise."""
        self._require_process()
        try:
            async with self.backend.session.post(
                    self.url + path, json=body,
                    timeout=aiohttp.ClientTimeout(total=self._request_timeout())) as response:
                status, text = response.status, await response.text()
        except TimeoutError:
            raise ServiceError(failure_code, f"{path}: no answer within {self._request_timeout():g} s") from None
        except aiohttp.ClientConnectionError as error:
            raise ServiceError("service_unavailable", f"{path}: {error}; {self._process_state()}") from None
        except aiohttp.ClientError as error:
            raise ServiceError(failure_code, f"{path}: {error}") from None
        if status in (400, 413, 422) and refused_code is not None:
            raise ServiceError(refused_code, _server_message(text))
        if status != 200:
            raise ServiceError(failure_code, f"{path} answered {status}: {_server_message(text)}")
        try:
            return json.loads(text)
        except ValueError:
            raise ServiceError(failure_code, f"{path} answered 200 without JSON: {text[:MESSAGE_CHARS]!r}") from None

    def _request_timeout(self) -> float:
        return self.options.request_timeout_s

    def _require_process(self) -> None:
        if self.process is None:
            raise ServiceError("service_unavailable", "the instance has no server (not prepared, or closed)")
        if self.process.returncode is not None:
            raise ServiceError("service_unavailable", f"{self._process_state()}\n{self._log_tail()}")

    def _process_state(self) -> str:
        if self.process is None or self.process.returncode is None:
            return "server process running"
        return f"server process exited with code {self.process.returncode}"

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                tail = log.read().decode(errors="replace")
        except OSError as error:
            return f"(log {self.log_path} unreadable: {error})"
        return f"last lines of {self.log_path}:\n{tail}"


def free_port() -> int:
    """A loopback port nobody listens on right now (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _classify_body(request: Mapping[str, Any]) -> dict[str, Any]:
    return {"text": list(request["texts"])}


def _classify_result(request: Mapping[str, Any], answer: Any) -> dict[str, Any]:
    """A reward head's output is a one-element "embedding" per text; a multi-class head is not a reward model."""
    scores = [float(score) for (score,) in (item["embedding"] for item in answer)]
    return {"scores": _counted(scores, len(request["texts"]))}


def _score_body(request: Mapping[str, Any]) -> dict[str, Any]:
    return {"query": request["query"], "items": list(request["items"]),
            "label_token_ids": list(request["label_token_ids"])}


def _score_result(request: Mapping[str, Any], answer: Any) -> dict[str, Any]:
    labels = len(request["label_token_ids"])
    rows = [_counted([float(p) for p in row], labels) for row in answer["scores"]]
    return {"scores": _counted(rows, len(request["items"]))}


def _generate_body(request: Mapping[str, Any]) -> dict[str, Any]:
    return {"text": list(request["prompts"]), "sampling_params": dict(request["sampling_params"])}


def _generate_result(request: Mapping[str, Any], answer: Any) -> dict[str, Any]:
    texts = [item["text"] for item in answer]
    if not all(isinstance(text, str) for text in texts):
        raise TypeError("a text is not a string")
    return {"texts": _counted(texts, len(request["prompts"]))}


def _similarity_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """Responses then references, in one call."""
    pairs = request["pairs"]
    return {"input": [response for response, _ in pairs] + [reference for _, reference in pairs]}


def _similarity_result(request: Mapping[str, Any], answer: Any) -> dict[str, Any]:
    """Cosine of each response's embedding with its reference's (0 when either is the zero vector)."""
    count = len(request["pairs"])
    data = sorted(answer["data"], key=lambda item: item["index"])
    vectors = np.asarray(_counted([item["embedding"] for item in data], 2 * count), dtype=np.float64)
    if vectors.ndim != 2:
        raise ValueError("embeddings of different lengths")
    responses, references = vectors[:count], vectors[count:]
    norms = np.linalg.norm(responses, axis=1) * np.linalg.norm(references, axis=1)
    dots = np.einsum("ij,ij->i", responses, references)
    return {"scores": np.divide(dots, norms, out=np.zeros(count), where=norms > 0).tolist()}


#: task -> (endpoint, request body from the validated input, result from the server's answer)
ENDPOINTS: dict[str, tuple[str, Callable[[Mapping[str, Any]], dict[str, Any]],
                           Callable[[Mapping[str, Any], Any], dict[str, Any]]]] = {
    "classify": ("/classify", _classify_body, _classify_result),
    "score": ("/v1/score", _score_body, _score_result),
    "generate": ("/generate", _generate_body, _generate_result),
    "similarity": ("/v1/embeddings", _similarity_body, _similarity_result),
}


def _counted(items: list[Any], expected: int) -> list[Any]:
    if len(items) != expected:
        raise ValueError(f"{len(items)} results for {expected} inputs")
    return items


def _server_message(text: str) -> str:
    """The message of SGLang's native (``{"error": {"message"}}``) or OpenAI-style (``{"message"}``) error body."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:MESSAGE_CHARS]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:MESSAGE_CHARS]
        if isinstance(body.get("message"), str):
            return body["message"][:MESSAGE_CHARS]
    return text[:MESSAGE_CHARS]


def _group_processes(group: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass
