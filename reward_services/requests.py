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
from typing import Any

from tangram.core.errors import BadRequest, TooLarge

SPEC_FIELDS = frozenset({"service", "input"})
INPUT_FIELDS = {
    "similarity": frozenset({"pairs"}),
    "classify": frozenset({"texts"}),
    "score": frozenset({"query", "items", "label_token_ids"}),
    "generate": frozenset({"prompts", "sampling_params"}),
}
SAMPLING_FIELDS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop"})


@dataclass(frozen=True)
class RewardLimits:
    """What one reward action may send: items per request and bytes of text over all items."""

    max_items: int = 1024
    max_input_bytes: int = 4 << 20
    max_new_tokens: int = 4096


def parse_reward_input(task: str, raw: Any, limits: RewardLimits, where: str = "spec.input") -> dict[str, Any]:
    """Validate ``raw`` for ``task``; returns a clean copy (413 when too large, 400 when malformed)."""
    if not isinstance(raw, dict):
        raise BadRequest(where, f"must be an object with {sorted(INPUT_FIELDS[task])}")
    unknown = sorted(set(raw) - INPUT_FIELDS[task])
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]}", f"unknown field; {task} services take {sorted(INPUT_FIELDS[task])}")
    budget = _Budget(limits.max_input_bytes, where)
    if task == "similarity":
        pairs = _items(raw.get("pairs"), f"{where}.pairs", limits)
        clean = []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, list) or len(pair) != 2:
                raise BadRequest(f"{where}.pairs[{i}]", "must be a [response, reference] pair of strings")
            clean.append((budget.text(pair[0], f"{where}.pairs[{i}][0]"), budget.text(pair[1], f"{where}.pairs[{i}][1]")))
        return {"pairs": clean}
    if task == "classify":
        texts = _items(raw.get("texts"), f"{where}.texts", limits)
        return {"texts": [budget.text(t, f"{where}.texts[{i}]") for i, t in enumerate(texts)]}
    if task == "score":
        query = budget.text(raw.get("query"), f"{where}.query")
        items = _items(raw.get("items"), f"{where}.items", limits)
        labels = raw.get("label_token_ids")
        if (not isinstance(labels, list) or not labels or len(labels) > 64
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in labels)):
            raise BadRequest(f"{where}.label_token_ids", "must be a list of 1 to 64 token ids (integers >= 0)")
        return {"query": query, "items": [budget.text(t, f"{where}.items[{i}]") for i, t in enumerate(items)],
                "label_token_ids": list(labels)}
    prompts = _items(raw.get("prompts"), f"{where}.prompts", limits)
    return {"prompts": [budget.text(t, f"{where}.prompts[{i}]") for i, t in enumerate(prompts)],
            "sampling_params": _sampling(raw.get("sampling_params", {}), f"{where}.sampling_params", limits)}


def parse_reward_spec(spec: Mapping[str, Any], where: str = "spec") -> tuple[str, Any]:
    """The service name and the raw input (validated against the service's task by the caller)."""
    unknown = sorted(set(spec) - SPEC_FIELDS)
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]}", f"unknown field; reward specs take {sorted(SPEC_FIELDS)}")
    service = spec.get("service")
    if not isinstance(service, str) or not service:
        raise BadRequest(f"{where}.service", "must name a registered reward service (GET /v1/services)")
    if "input" not in spec:
        raise BadRequest(f"{where}.input", "missing: the request for the reward service")
    return service, spec["input"]


class _Budget:
    """Counts UTF-8 bytes of text over a whole input against one limit."""

    def __init__(self, limit: int, where: str) -> None:
        self.left = limit
        self.limit = limit
        self.where = where

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise BadRequest(field, "must be a string")
        self.left -= len(value.encode())
        if self.left < 0:
            raise TooLarge(self.where, f"text over all items exceeds {self.limit} bytes")
        return value


def _items(value: Any, field: str, limits: RewardLimits) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise BadRequest(field, "must be a non-empty list")
    if len(value) > limits.max_items:
        raise TooLarge(field, f"{len(value)} items; at most {limits.max_items} per action")
    return value


def _sampling(value: Any, field: str, limits: RewardLimits) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(field, "must be an object")
    unknown = sorted(set(value) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"{field}.{unknown[0]}", f"unknown field; known are {sorted(SAMPLING_FIELDS)}")
    tokens = value.get("max_new_tokens", 256)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= limits.max_new_tokens:
        raise BadRequest(f"{field}.max_new_tokens", f"must be an integer from 1 to {limits.max_new_tokens}")
    for name, low, high in (("temperature", 0.0, 10.0), ("top_p", 0.0, 1.0)):
        if name in value:
            number = value[name]
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not low <= number <= high:
                raise BadRequest(f"{field}.{name}", f"must be a number from {low} to {high}")
    if "top_k" in value and (isinstance(value["top_k"], bool) or not isinstance(value["top_k"], int)):
        raise BadRequest(f"{field}.top_k", "must be an integer")
    stop = value.get("stop", [])
    if not isinstance(stop, list) or len(stop) > 16 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"{field}.stop", "must be a list of at most 16 non-empty strings")
    return {**value, "max_new_tokens": tokens}
