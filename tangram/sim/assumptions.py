"""The simulator's assumed parameters, overridden from the command line (``--set group.field=value``).

Every figure in docs/EVALUATION.md rests on assumptions (``tangram/sim/cluster.py``, ``tangram/sim/workloads.py``);
the ones that decide a headline figure must be easy to move, so that a figure can be given at the assumed value and
at the other plausible end. The scenarios build their workloads and clusters through ``Assumptions``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from tangram.sim.cluster import ApiModel, Costs, HeteroParams, StaticServing
from tangram.sim.slo_workload import SloTaskParams
from tangram.sim.training import StepParams
from tangram.sim.workloads import CodingParams, MopdParams, SearchParams

#: what each group overrides; the search upstreams (``api``) take their quota and concurrency, the static GPU
#: deployment's servers (``static``) their batching, a training run (``step``) its steps, the tasks offered to a
#: shared pool (``slo``) their steps and SLOs, the mixed cluster's H20 (``hetero``) its speeds
GROUPS: Mapping[str, type] = MappingProxyType({"costs": Costs, "coding": CodingParams, "mopd": MopdParams,
                                               "search": SearchParams, "api": ApiModel, "static": StaticServing,
                                               "step": StepParams, "slo": SloTaskParams, "hetero": HeteroParams})
#: fields below 1 mean nothing: an upstream or a server takes some calls, a run has a step, a window some time, an
#: SLO tolerates no speed-up, a task has a GPU and a step, a reward's longest is no shorter than its median, the
#: H20 is no slower than its datasheet
AT_LEAST_ONE = frozenset({"static.batch", "step.steps", "step.window_s", "slo.candidates", "slo.steps",
                          "slo.slo_low", "slo.slo_high", "slo.reward_cap", "slo.unchecked", "hetero.tflops_factor",
                          "hetero.hbm_factor"})
#: fields a scenario sets itself (what it sweeps or how it is defined), so an override would be silently lost
SCENARIO_FIELDS = frozenset({"coding.batch", "mopd.batch", "mopd.teachers", "search.batch", "search.task",
                             "api.name", "api.period_s"})


@dataclass(frozen=True)
class Assumptions:
    """Overrides per group: field name -> value."""

    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def costs(self) -> Costs:
        return Costs(**self.overrides.get("costs", {}))

    def coding(self, **params: Any) -> CodingParams:
        return CodingParams(**{**self.overrides.get("coding", {}), **params})

    def mopd(self, **params: Any) -> MopdParams:
        return MopdParams(**{**self.overrides.get("mopd", {}), **params})

    def search(self, **params: Any) -> SearchParams:
        return SearchParams(**{**self.overrides.get("search", {}), **params})

    def static(self) -> StaticServing:
        return StaticServing(**self.overrides.get("static", {}))

    def step(self) -> StepParams:
        return StepParams(**self.overrides.get("step", {}))

    def slo(self) -> SloTaskParams:
        return SloTaskParams(**self.overrides.get("slo", {}))

    def hetero(self) -> HeteroParams:
        return HeteroParams(**self.overrides.get("hetero", {}))

    def api(self, base: ApiModel) -> ApiModel:
        return replace(base, **self.overrides.get("api", {}))

    def to_json(self) -> dict[str, Any]:
        return {f"{group}.{name}": value for group, values in self.overrides.items() for name, value in values.items()}


def parse(items: Iterable[str]) -> Assumptions:
    """``group.field=value`` items as overrides; ValueError naming the item and why it cannot be set."""
    overrides: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        group, dot, attribute = name.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"{item!r}: expected group.field=value, e.g. costs.pod_bind_per_s=100")
        if group not in GROUPS:
            raise ValueError(f"{item!r}: unknown group {group!r} (one of {', '.join(GROUPS)})")
        fields = {f.name: f for f in dataclasses.fields(GROUPS[group]) if f.init}
        if attribute not in fields:
            raise ValueError(f"{item!r}: {group} has no field {attribute!r} (one of {', '.join(sorted(fields))})")
        if name in SCENARIO_FIELDS:
            raise ValueError(f"{item!r}: the scenarios set {name} themselves")
        default = getattr(GROUPS[group](**_required(group)), attribute)
        if isinstance(default, str):
            value = _choice(item, group, attribute, text.strip())
        else:
            value = _value(item, default, text.strip(), 1 if group == "api" or name in AT_LEAST_ONE else 0)
        overrides.setdefault(group, {})[attribute] = value
    return Assumptions({group: MappingProxyType(values) for group, values in overrides.items()})


def _required(group: str) -> dict[str, Any]:
    """Arguments without defaults, to read the defaults' types from an instance."""
    return {"name": "api"} if group == "api" else {}


def _choice(item: str, group: str, attribute: str, text: str) -> str:
    """``text`` as a field that names one of a few choices: the group's dataclass checks it."""
    try:
        GROUPS[group](**_required(group), **{attribute: text})
    except ValueError as error:
        raise ValueError(f"{item!r}: {error}") from None
    return text


def _value(item: str, default: Any, text: str, minimum: int) -> Any:
    """``text`` as the type of the field's default (an int or a float), finite and at least ``minimum``: no
    assumed parameter here is negative."""
    kind = type(default)
    try:
        value = kind(text) if kind in (int, float) else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{item!r}: expected {'an integer' if kind is int else 'a number'} of at least {minimum}, "
                         f"got {text!r}")
    return value
