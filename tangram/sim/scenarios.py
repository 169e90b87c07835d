"""The paper's evaluation as runnable scenarios (§6): each sweeps a workload over batch size or capacity under
the broker and its baselines, and reports the paper's figure, ours and their ratio. This module is the registry
(``tangram simulate``'s scenario names); the scenarios live by concept in ``coding_scenarios``, ``gpu_scenarios``,
``slo_scenario``, ``e2e_scenarios``, ``sensitivity`` and ``partition_scenario``, on ``scenario_common``.
"""

from __future__ import annotations

from collections.abc import Callable

from tangram.sim.coding_scenarios import coding_batch, coding_capacity, dop
from tangram.sim.e2e_scenarios import breakdown, e2e, training
from tangram.sim.gpu_scenarios import gpu_batch, gpu_cost, gpu_hetero, gpu_hrrs, gpu_tiers
from tangram.sim.partition_scenario import partitions
from tangram.sim.scenario_common import Outcome
from tangram.sim.sensitivity import sensitivity
from tangram.sim.slo_scenario import gpu_slo

SCENARIOS: dict[str, Callable[..., Outcome]] = {
    "coding-batch": coding_batch, "coding-capacity": coding_capacity, "dop": dop, "gpu-batch": gpu_batch,
    "gpu-cost": gpu_cost, "gpu-hrrs": gpu_hrrs, "gpu-tiers": gpu_tiers, "gpu-slo": gpu_slo, "gpu-hetero": gpu_hetero,
    "breakdown": breakdown, "e2e": e2e, "training": training, "sensitivity": sensitivity,
    "partitions": partitions}
