"""The ``spec`` of a ``reward`` action, validated at submit so a backend only ever sees well-formed input.

``spec = {"service": NAME, "input": {...}}``; the input's shape depends on the service's task:

* ``similarity``: ``{"pairs": [[response, reference], ...]}`` -> ``{"scores": [cosine, ...]}``
* ``classify``: ``{"texts": [text, ...]}`` -> ``{"scores": [reward, ...]}`` (a reward model's head)
* ``score``: ``{"query": text, "items": [text, ...], "label_token_ids": [id, ...]}`` ->
  ``{"scores": [[p per label token], ...]}`` (SGLang's ``/v1/score``)
* ``generate``: ``{"prompts": [text, ...], "sampling_params": {...}}`` -> ``{"texts": [text, ...]}`` (LLM judge)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from tangram.core.config_tables import TABLE, Count
from tangram.core.errors import TooLarge, Unprocessable
from tangram.core.schema import Integer, NonNegativeInteger, PositiveInteger, Schema, parse


@dataclass(frozen=True)
class RewardLimits:
    """What one reward action may send: items per request and bytes of text over all items."""

    __pydantic_config__ = TABLE

    max_items: Count = 1024
    max_input_bytes: Count = 4 << 20
    max_new_tokens: Count = 4096


class RewardSpecBody(Schema):
    """A reward action's ``spec``: which service, and its input (shaped by the service's task)."""

    service: str = Field(min_length=1, description="a registered reward service (GET /v1/services)")
    input: dict[str, Any] = Field(description="the request for the service; its fields depend on the service's "
                                              "task (similarity, classify, score, generate)")


class SimilarityInput(Schema):
    pairs: list[Annotated[list[str], Field(min_length=2, max_length=2)]] = Field(
        min_length=1, description="[response, reference] pairs")


class ClassifyInput(Schema):
    texts: list[str] = Field(min_length=1)


class ScoreInput(Schema):
    query: str
    items: list[str] = Field(min_length=1)
    label_token_ids: list[NonNegativeInteger] = Field(min_length=1, max_length=64)


class Sampling(Schema):
    max_new_tokens: PositiveInteger = 256
    temperature: Annotated[float, Field(ge=0, le=10)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Integer | None = None
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)


class GenerateInput(Schema):
    prompts: list[str] = Field(min_length=1)
    sampling_params: Sampling | None = None


REWARD_SPEC = TypeAdapter(RewardSpecBody)
INPUTS: dict[str, TypeAdapter[Any]] = {"similarity": TypeAdapter(SimilarityInput),
                                       "classify": TypeAdapter(ClassifyInput), "score": TypeAdapter(ScoreInput),
                                       "generate": TypeAdapter(GenerateInput)}


@dataclass(frozen=True)
class RewardRequest:
    """A reward spec as the GPU manager uses it: the service and the backend's request, checked once."""

    service: str
    request: dict[str, Any]


def parse_reward_spec(spec: Mapping[str, Any], where: str = "spec") -> RewardSpecBody:
    """The service name and the raw input (validated against the service's task by ``parse_reward_input``)."""
    return parse(REWARD_SPEC, spec, where)


def parse_reward_input(task: str, raw: Any, limits: RewardLimits, where: str = "spec.input") -> dict[str, Any]:
    """Validate ``raw`` for ``task``; returns the backend's request (413 when too large, 400 when malformed, 422
    past the configured ``max_new_tokens``). A request it returned passes again unchanged, so a node agent checks
    what reaches it with this same function."""
    body = parse(INPUTS[task], raw, where)
    for name in ("pairs", "texts", "items", "prompts"):
        items = getattr(body, name, None)
        if items is not None and len(items) > limits.max_items:
            raise TooLarge(f"{where}.{name}", f"{len(items)} items; at most {limits.max_items} per action")
    texts = [text for pair in body.pairs for text in pair] if isinstance(body, SimilarityInput) else \
        body.texts if isinstance(body, ClassifyInput) else [body.query, *body.items] if isinstance(body, ScoreInput) \
        else list(body.prompts)
    if sum(len(text.encode()) for text in texts) > limits.max_input_bytes:
        raise TooLarge(where, f"text over all items exceeds {limits.max_input_bytes} bytes")
    if isinstance(body, GenerateInput):
        sampling = body.sampling_params or Sampling()
        if sampling.max_new_tokens > limits.max_new_tokens:
            raise Unprocessable(f"{where}.sampling_params.max_new_tokens",
                                f"must be an integer from 1 to {limits.max_new_tokens}")
        return {"prompts": body.prompts, "sampling_params": {
            **sampling.model_dump(exclude_unset=True, exclude_none=True), "max_new_tokens": sampling.max_new_tokens}}
    return body.model_dump()
