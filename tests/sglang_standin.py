"""A STAND-IN for an SGLang server, for tests only: it is not SGLang and runs no model.

``python -m tests.sglang_standin --model-path DIR --tp-size N --host H --port P [--enable-memory-saver]
[--enable-weights-cpu-backup] [--is-embedding] [--mem-fraction-static F] [--context-length N]`` follows the
endpoints, bodies and behaviours of ``python -m sglang.launch_server`` as read in github.com/sgl-project/sglang:
``python/sglang/srt/entrypoints/http_server.py`` (routes, methods, status codes, error bodies),
``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``, ``EmbeddingReqInput``, the memory requests'
``tags``), ``python/sglang/srt/entrypoints/openai/protocol.py`` (embeddings and scoring bodies),
``python/sglang/srt/constants.py`` (tag names), ``python/sglang/srt/managers/scheduler_update_weights_mixin.py``
and ``python/sglang/srt/torch_memory_saver_adapter.py`` (what release and resume do), and
``docs/advanced_features/server_arguments.md`` (flags). Unknown flags exit 2 (argparse, as SGLang's).

It serves only ``/health``, ``/health_generate``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
``/classify``, ``/v1/score``, ``/generate`` and ``/v1/embeddings``, and refuses anything else: unknown paths 404,
wrong methods 405, malformed bodies or fields it does not model (token ids, images, streaming...) 400, which is
stricter than SGLang. Outputs are fake but deterministic (``fake_*`` below, so tests can check values); one token
is one UTF-8 byte. Like SGLang:

* ``/health`` is 503 for ``STANDIN_START_DELAY_S`` (default 0.2) after start, then 200.
* Without ``--enable-memory-saver`` a release only logs SGLang's warning and keeps the memory (200 ``null``).
* Resuming weights that were released without ``--enable-weights-cpu-backup`` gives uninitialised (here: zero)
  weights and no error: rewards 0, zero embeddings, uniform label probabilities, token 0 (``!``) generated.
* Resuming a tag that is not released kills the server (SGLang's scheduler raises KeyError and takes it down).
* Input longer than the context length (``--context-length``, default 32768) is a 400 with SGLang's message, and
  the wrong endpoint for the model kind (``--is-embedding`` or not) is a 400.

Choices where SGLang has no guard: inference or ``/health`` while memory is released is a 503 (SGLang would run on
unmapped memory and fault), and unknown tags are a 400 (SGLang ignores them).

It plays the GPU driver too: the visible devices come from ``CUDA_VISIBLE_DEVICES`` (the first ``--tp-size`` of
them are used); its memory per device (``STANDIN_CONTEXT_MB``, default 100, while it runs, plus
``STANDIN_GPU_MEMORY_MB``, default 1000, while loaded and not released) goes to the JSON file named by
``STANDIN_MEMORY_FILE`` as ``{pid: {device: MB}}`` under ``flock``, for a test probe to read like nvidia-smi.
Released memory leaves that file only ``STANDIN_RELEASE_DELAY_S`` (default 0.3) after the release answered, as
the driver lags SGLang. It starts one child process standing for SGLang's scheduler, so tests see that a whole
process group is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

#: SGLang's GPU_MEMORY_ALL_TYPES, with the share of the loaded memory each region holds here
TAG_SHARES = {"kv_cache": 0.45, "weights": 0.5, "weights_drafter": 0.0, "cuda_graph": 0.05}
VOCAB_SIZE = 32000
EMBEDDING_DIM = 8
DEFAULT_CONTEXT_LENGTH = 32768
DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default
SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop", "min_p",
                           "repetition_penalty", "frequency_penalty", "presence_penalty", "ignore_eos"})
NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. "
                 "Please add `--is-embedding` when launching the server or try another model.")
NOT_GENERATION = "This model is an embedding model (--is-embedding): it does not generate or score tokens."

log = logging.getLogger("sglang-standin")


def fake_reward(text: str) -> float:
    """The reward head's score for ``text``, in [-4, 4)."""
    return _unit("reward", text) * 8 - 4


def fake_embedding(text: str) -> list[float]:
    """An ``EMBEDDING_DIM`` vector fixed by ``text``."""
    digest = hashlib.sha256(f"embedding\x1f{text}".encode()).digest()
    return [byte / 255 - 0.5 for byte in digest[:EMBEDDING_DIM]]


def fake_label_probs(query: str, item: str, label_token_ids: list[int], apply_softmax: bool = False) -> list[float]:
    """Probability of each label token after query + item (``/v1/score``), renormalised over them on request."""
    probs = [_unit("score", query, item, str(token)) / 4 for token in label_token_ids]
    if apply_softmax:
        return [p / sum(probs) for p in probs]
    return probs


def fake_completion(prompt: str, max_new_tokens: int) -> str:
    """The judge's greedy completion: one character per token, at most ``max_new_tokens``."""
    return f"verdict {hashlib.sha256(prompt.encode()).hexdigest()}"[:max_new_tokens]


def _unit(*parts: str) -> float:
    return int.from_bytes(hashlib.sha256("\x1f".join(parts).encode()).digest()[:4], "big") / 2**32


class Refused(Exception):
    """A request SGLang would answer with an error; the middleware writes it in the endpoint's error shape."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class StandinServer:
    """One server's state: loaded or not, which regions are released, whether the weights survived a resume."""

    def __init__(self, args: argparse.Namespace, devices: list[int]) -> None:
        self.args = args
        self.devices = devices
        self.context_length = args.context_length or DEFAULT_CONTEXT_LENGTH
        self.memory_file = os.environ.get("STANDIN_MEMORY_FILE")
        self.context_mb = int(os.environ.get("STANDIN_CONTEXT_MB", "100"))
        self.loaded_mb = int(os.environ.get("STANDIN_GPU_MEMORY_MB", "1000"))
        self.start_delay_s = float(os.environ.get("STANDIN_START_DELAY_S", "0.2"))
        self.release_delay_s = float(os.environ.get("STANDIN_RELEASE_DELAY_S", "0.3"))
        self.loaded = False
        self.offload_tags: set[str] = set()  # SGLang's bookkeeping, kept even when nothing is really paused
        self.freed_at: dict[str, float] = {}  # paused regions -> when the driver stops counting them
        self.weights_lost = False
        self.scheduler: asyncio.subprocess.Process | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.error_shapes])
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        for path, handler in (("/release_memory_occupation", self.release), ("/resume_memory_occupation", self.resume)):
            app.router.add_get(path, handler)
            app.router.add_post(path, handler)
        for path, handler in (("/generate", self.generate), ("/classify", self.classify)):
            app.router.add_post(path, handler)
            app.router.add_put(path, handler)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/score", self.score)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    @web.middleware
    async def error_shapes(self, request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Native endpoints answer ``{"error": {"message"}}``, OpenAI ones ``ErrorResponse`` (http_server.py)."""
        try:
            return await handler(request)
        except Refused as refusal:
            body: dict[str, Any]
            if request.path.startswith("/v1/"):
                body = {"object": "error", "message": refusal.message, "param": None, "code": refusal.status,
                        "type": "BadRequestError" if refusal.status == 400 else "ServiceUnavailableError"}
            else:
                body = {"error": {"message": refusal.message}}
            return web.json_response(body, status=refusal.status)

    async def start(self, app: web.Application) -> None:
        self.scheduler = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(86400)")
        self.publish()
        asyncio.get_running_loop().call_later(self.start_delay_s, self.finish_loading)

    def finish_loading(self) -> None:
        self.loaded = True
        self.publish()
        log.info("The server is fired up and ready to roll! (stand-in, devices %s)", self.devices)

    async def stop(self, app: web.Application) -> None:
        if self.scheduler is not None and self.scheduler.returncode is None:
            self.scheduler.terminate()
            await self.scheduler.wait()
        self.loaded = False
        self.publish(gone=True)

    # ----------------------------------------------------------------------------- memory, as the driver sees it

    def used_mb(self) -> int:
        if not self.loaded:
            return self.context_mb
        now = time.monotonic()
        share = sum(part for tag, part in TAG_SHARES.items() if now < self.freed_at.get(tag, now + 1))
        return self.context_mb + round(self.loaded_mb * share)

    def publish(self, gone: bool = False) -> None:
        if not self.memory_file:
            return
        with open(self.memory_file, "a+") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            file.seek(0)
            text = file.read()
            table = json.loads(text) if text.strip() else {}
            if gone:
                table.pop(str(os.getpid()), None)
            else:
                table[str(os.getpid())] = {str(device): self.used_mb() for device in self.devices}
            file.seek(0)
            file.truncate()
            json.dump(table, file)

    # ----------------------------------------------------------------------------------------- control endpoints

    async def health(self, request: web.Request) -> web.Response:
        if not self.loaded or self.freed_at:
            return web.Response(status=503)
        return web.Response(status=200)

    async def release(self, request: web.Request) -> web.Response:
        tags = self.tags(await self.body(request, {"tags"}))
        self.offload_tags |= set(tags)
        if not self.args.enable_memory_saver:
            log.warning("`release_memory_occupation` will not save memory because torch_memory_saver is not enabled.")
            return web.json_response(None)
        freed_at = time.monotonic() + self.release_delay_s
        for tag in tags:
            self.freed_at.setdefault(tag, freed_at)
        asyncio.get_running_loop().call_later(self.release_delay_s + 0.01, self.publish)
        log.info("released %s", tags)
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        tags = self.tags(await self.body(request, {"tags"}))
        missing = [tag for tag in tags if tag not in self.offload_tags]
        if missing:
            log.error("Scheduler hit an exception: KeyError: %r (resumed a tag that was not released)", missing[0])
            os._exit(1)
        self.offload_tags -= set(tags)
        if "weights" in tags and "weights" in self.freed_at and not self.args.enable_weights_cpu_backup:
            self.weights_lost = True  # fresh device memory, nothing copied back
        for tag in tags:
            self.freed_at.pop(tag, None)
        self.publish()
        log.info("resumed %s", tags)
        return web.json_response(None)

    def tags(self, body: dict[str, Any]) -> list[str]:
        tags = body.get("tags")
        if not tags:
            return list(TAG_SHARES)
        if not isinstance(tags, list) or not all(tag in TAG_SHARES for tag in tags):
            raise Refused(f"tags must be a list of {sorted(TAG_SHARES)}")
        return tags

    # -------------------------------------------------------------------------------------- inference endpoints

    async def generate(self, request: web.Request) -> web.Response:
        body = await self.body(request, {"text", "sampling_params", "rid"})
        texts, single = self.texts(body.get("text"), "text")
        max_new_tokens = self.sampling(body.get("sampling_params"))
        if self.args.is_embedding:
            raise Refused(NOT_GENERATION)
        self.check_resident()
        outputs = [{"text": "!" * max_new_tokens if self.weights_lost else fake_completion(text, max_new_tokens),
                    "meta_info": {"id": f"standin-{i}", "prompt_tokens": len(text.encode()),
                                  "completion_tokens": max_new_tokens, "cached_tokens": 0,
                                  "finish_reason": {"type": "length", "length": max_new_tokens}}}
                   for i, text in enumerate(texts)]
        return web.json_response(outputs[0] if single else outputs)

    async def classify(self, request: web.Request) -> web.Response:
        body = await self.body(request, {"text", "rid"})
        texts, single = self.texts(body.get("text"), "text")
        if not self.args.is_embedding:
            raise Refused(NOT_EMBEDDING)
        self.check_resident()
        outputs = [{"embedding": [0.0 if self.weights_lost else fake_reward(text)],
                    "meta_info": {"id": f"standin-{i}", "prompt_tokens": len(text.encode())}}
                   for i, text in enumerate(texts)]
        return web.json_response(outputs[0] if single else outputs)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self.body(request, {"input", "model", "encoding_format", "user"}, openai=True)
        texts, _ = self.texts(body.get("input"), "input")
        if body.get("encoding_format", "float") != "float":
            raise Refused("encoding_format: the stand-in answers only 'float'")
        if not self.args.is_embedding:
            raise Refused(NOT_EMBEDDING)
        self.check_resident()
        data = [{"object": "embedding", "index": i,
                 "embedding": [0.0] * EMBEDDING_DIM if self.weights_lost else fake_embedding(text)}
                for i, text in enumerate(texts)]
        tokens = sum(len(text.encode()) for text in texts)
        return web.json_response({"object": "list", "data": data, "model": body.get("model", self.args.model_path),
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                            "prompt_tokens_details": None}})

    async def score(self, request: web.Request) -> web.Response:
        body = await self.body(request, {"query", "items", "label_token_ids", "apply_softmax", "item_first",
                                         "model"}, openai=True)
        (query,), _ = self.texts(body.get("query"), "query", allow_list=False)
        items, _ = self.texts(body.get("items"), "items")
        labels = body.get("label_token_ids")
        if not isinstance(labels, list) or not labels or not all(type(t) is int and t >= 0 for t in labels):
            raise Refused("label_token_ids must be a non-empty list of token ids")
        for token in labels:
            if token >= VOCAB_SIZE:
                raise Refused(f"Token ID {token} is out of vocabulary (vocab size: {VOCAB_SIZE})")
        apply_softmax, item_first = body.get("apply_softmax", False), body.get("item_first", False)
        if not isinstance(apply_softmax, bool) or not isinstance(item_first, bool):
            raise Refused("apply_softmax and item_first must be booleans")
        if self.args.is_embedding:
            raise Refused(NOT_GENERATION)
        for item in items:
            self.check_length(query + item)
        self.check_resident()
        if self.weights_lost:
            scores = [[1 / (VOCAB_SIZE if not apply_softmax else len(labels))] * len(labels) for _ in items]
        else:
            scores = [fake_label_probs(item if item_first else query, query if item_first else item, labels,
                                       apply_softmax) for item in items]
        return web.json_response({"scores": scores, "model": body.get("model", self.args.model_path),
                                  "usage": None, "object": "scoring"})

    # -------------------------------------------------------------------------------------------------- checks

    async def body(self, request: web.Request, fields: set[str], openai: bool = False) -> dict[str, Any]:
        if openai and request.content_type != "application/json":
            raise Refused("Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = json.loads(await request.text())
        except ValueError:
            raise Refused("malformed JSON body") from None
        if not isinstance(body, dict):
            raise Refused("the body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            raise Refused(f"{unknown[0]}: not a field the stand-in models (it takes {sorted(fields)})")
        return body

    def texts(self, value: Any, field: str, allow_list: bool = True) -> tuple[list[str], bool]:
        """The texts of a string or a non-empty list of strings, each within the context length."""
        if isinstance(value, str):
            texts, single = [value], True
        elif allow_list and isinstance(value, list) and value and all(isinstance(text, str) for text in value):
            texts, single = value, False
        else:
            raise Refused(f"{field} must be a string" + (" or a non-empty list of strings" if allow_list else ""))
        for text in texts:
            self.check_length(text)
        return texts, single

    def check_length(self, text: str) -> None:
        tokens = len(text.encode())
        if tokens >= self.context_length:
            raise Refused(f"The input ({tokens} tokens) is longer than the model's context length "
                          f"({self.context_length} tokens).")

    def sampling(self, params: Any) -> int:
        """Validate ``sampling_params`` (a dict) like SamplingParams.verify; the number of tokens to generate."""
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise Refused("sampling_params must be an object")
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            raise Refused(f"sampling_params.{unknown[0]}: not a sampling parameter the stand-in models")
        max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if type(max_new_tokens) is not int or max_new_tokens < 0:
            raise Refused(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        temperature = params.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
            raise Refused(f"temperature must be non-negative, got {temperature}.")
        top_p = params.get("top_p", 1.0)
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise Refused(f"top_p must be in (0, 1], got {top_p}.")
        return max_new_tokens

    def check_resident(self) -> None:
        if not self.loaded:
            raise Refused("the server is still starting", status=503)
        if self.freed_at:
            raise Refused(f"memory is released ({sorted(self.freed_at)}): resume it before inference", status=503)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.sglang_standin", allow_abbrev=False,
                                     description="A stand-in for sglang.launch_server (tests only).")
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--tp-size", "--tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--is-embedding", action="store_true")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--context-length", type=int)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[stand-in %(asctime)s] %(message)s")
    visible = [int(device) for device in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
    if args.tp_size < 1 or len(visible) < args.tp_size:
        log.error("RuntimeError: --tp-size %d needs that many GPUs; CUDA_VISIBLE_DEVICES shows %s",
                  args.tp_size, visible)
        sys.exit(1)
    if not Path(args.model_path).is_dir():
        log.error("OSError: model path %s is not a local directory (the stand-in never downloads)", args.model_path)
        sys.exit(1)
    log.info("stand-in for sglang.launch_server: %s", vars(args))
    server = StandinServer(args, visible[:args.tp_size])
    web.run_app(server.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
