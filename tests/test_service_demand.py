"""Demand per reward service (``managers/gpu/service_demand.py``): the exponentially weighted arrival rate (steady,
young, decaying), run GPU-seconds learned per GPU type from actions' ends, the speed prior that carries them to types
not seen yet, measured speeds and loads; and ``gpu_types.bound_of``, which gives each service its prior's bound."""

from __future__ import annotations

import math

import pytest

from managers.gpu.gpu_types import GPU_TYPES, REFERENCE_TYPE, bound_of
from managers.gpu.service_demand import MIN_GPU_S, PRIOR_GPU_S, RUN_EWMA_ALPHA, ServiceDemand
from reward_services.backend import TASKS
from tangram.core.action import Action, Demand, Kind

#: the GPU nodes the actions run on, by type
NODE_TYPES = {"a": "h100", "b": "h20"}
#: the prior's speed of H20 against H100: compute-bound by TFLOPS, memory-bound by HBM bandwidth
H20_COMPUTE = 148 / 989
H20_MEMORY = 4000 / 3350


def demand(window_s: float = 60.0) -> ServiceDemand:
    """``scorer`` is compute-bound, ``writer`` memory-bound; ``other`` names no bound (compute by default)."""
    return ServiceDemand(lambda action: action.spec["service"], NODE_TYPES.get, GPU_TYPES,
                         {"scorer": "compute", "writer": "memory"}, window_s)


def action(service: str, at: float = 0.0, kind: Kind = Kind.REWARD) -> Action:
    return Action(task="t", kind=kind, demands={"gpu": Demand((1,))}, spec={"service": service}, submitted_at=at)


def arrive(watcher: ServiceDemand, service: str, rate: float, start: float, end: float) -> float:
    """Arrivals every ``1 / rate`` seconds from ``start`` while before ``end``; returns the time one gap after the
    last (the instant the next would come): there the weighted count stands for a whole number of gaps."""
    gap = 1.0 / rate
    n = round((end - start) * rate)
    for k in range(n):
        watcher.submitted(action(service, start + k * gap))
    return start + n * gap


def end(watcher: ServiceDemand, service: str, node: str | None, execution_s: float, restore_s: float | None = None,
        gpus: int = 1, error: dict[str, str] | None = None) -> None:
    done = action(service)
    done.execution_s, done.restore_s, done.error = execution_s, restore_s, error
    done.units = {"gpu": gpus}
    done.placement = {"gpu": {"node": node, "gpus": list(range(gpus)), "service": service}} if node else {}
    watcher.ended(done)


def expected_ratio(rate: float, window_s: float) -> float:
    """``rate()`` over the true rate, read one gap after the last of evenly spaced arrivals: with ``q = exp(-x)``,
    ``x = gap / window_s``, the weighted count of ``n`` arrivals is ``q (1 - q^n) / (1 - q)`` and the window they had
    to build it up is ``window_s (1 - q^n)``, so the ratio is ``x / (e^x - 1)``, about ``1 - x / 2`` whatever ``n``
    (how long the arrivals have gone on)."""
    x = 1.0 / rate / window_s
    return x / math.expm1(x)


def test_a_steady_rate_over_several_windows_reads_as_itself() -> None:
    """2 arrivals/s for five 60 s windows: x = 1/120, so ``rate()`` is 2 * (1 - 1/240) or so, within 1%."""
    watcher = demand(window_s=60.0)
    now = arrive(watcher, "scorer", 2.0, 0.0, 300.0)
    assert watcher.rate("scorer", now) == pytest.approx(2.0, rel=0.01)
    assert watcher.rate("scorer", now) == pytest.approx(2.0 * expected_ratio(2.0, 60.0), rel=1e-9)
    assert watcher.rate("writer", now) == 0.0  # another service's arrivals are not its own


def test_a_young_broker_is_not_read_as_idle() -> None:
    """10 s of arrivals at 10/s against a 300 s window: the 100 arrivals are over the 10 s they had, not the window
    (which would read 100 / 300 = 0.33/s): the rate is 10 * (1 - 1/6000) or so."""
    watcher = demand(window_s=300.0)
    now = arrive(watcher, "scorer", 10.0, 1000.0, 1010.0)
    assert watcher.rate("scorer", now) == pytest.approx(10.0, rel=0.01)
    assert watcher.rate("scorer", now) == pytest.approx(10.0 * expected_ratio(10.0, 300.0), rel=1e-9)


def test_the_rate_decays_once_arrivals_stop() -> None:
    """After five windows at 2/s, one window of silence leaves about e^-1 of the rate (the window it is measured
    over grows by a factor (1 - e^-6) / (1 - e^-5) only), ten leave under e^-9."""
    watcher = demand(window_s=60.0)
    stop = arrive(watcher, "scorer", 2.0, 0.0, 300.0)
    before = watcher.rate("scorer", stop)
    later = [watcher.rate("scorer", stop + k * 60.0) for k in range(1, 11)]
    assert later[0] == pytest.approx(before * math.exp(-1) * -math.expm1(-5) / -math.expm1(-6), rel=1e-9)
    assert all(a > b for a, b in zip([before, *later], later, strict=False))
    assert later[-1] < before * math.exp(-9)
    watcher.submitted(action("scorer", stop + 600.0))  # one arrival restarts the count from what was left
    assert watcher.rate("scorer", stop + 600.0) > later[-1]


def test_actions_other_than_reward_ones_are_ignored() -> None:
    watcher = demand()
    for kind in (Kind.EXEC, Kind.API, Kind.LEASE):
        watcher.submitted(action("scorer", 10.0, kind))
        other = action("scorer", kind=kind)
        other.execution_s, other.units, other.placement = 3.0, {"gpu": 1}, {"gpu": {"node": "a"}}
        watcher.ended(other)
    assert watcher.rate("scorer", 10.0) == 0.0 and watcher.learned() == {}


def test_an_end_teaches_gpu_seconds_on_its_nodes_type_as_an_ewma() -> None:
    """(execution - restore) x GPUs: (3 - 1) x 2 = 4 GPU-s first, then 2 s on one GPU moves it by alpha."""
    watcher = demand()
    end(watcher, "scorer", "a", execution_s=3.0, restore_s=1.0, gpus=2)
    assert watcher.learned() == {"scorer": {"h100": 4.0}}
    end(watcher, "scorer", "a", execution_s=2.0)  # no restore: all of it is run time
    assert watcher.gpu_s("scorer", "h100") == pytest.approx(4.0 + RUN_EWMA_ALPHA * (2.0 - 4.0))
    end(watcher, "scorer", "b", execution_s=5.0, restore_s=1.0)
    assert watcher.learned() == {"scorer": {"h100": pytest.approx(3.6), "h20": 4.0}}
    end(watcher, "writer", "b", execution_s=0.5, restore_s=2.0)  # a restore longer than the run: the least run
    assert watcher.learned()["writer"] == {"h20": MIN_GPU_S}
    assert watcher.speed("writer", "h20") > 0  # a speed ratio divides by it: never by zero


def test_failed_actions_and_unknown_nodes_teach_nothing() -> None:
    watcher = demand()
    end(watcher, "scorer", "a", execution_s=3.0, error={"code": "service_error"})
    end(watcher, "scorer", "gone", execution_s=3.0)  # no longer a node the manager knows
    end(watcher, "scorer", None, execution_s=3.0)  # no GPU placement at all
    end(watcher, "scorer", "a", execution_s=3.0, gpus=0)
    unfinished = action("scorer")
    unfinished.units, unfinished.placement = {"gpu": 1}, {"gpu": {"node": "a"}}
    watcher.ended(unfinished)  # no execution_s
    assert watcher.learned() == {}
    assert watcher.gpu_s("scorer", "h100") == PRIOR_GPU_S


def test_a_type_not_seen_yet_is_carried_over_by_the_prior_speed() -> None:
    watcher = demand()
    assert watcher.gpu_s("scorer", REFERENCE_TYPE) == PRIOR_GPU_S  # nothing learned: the prior
    assert watcher.gpu_s("scorer", "h20") == pytest.approx(PRIOR_GPU_S / H20_COMPUTE)
    end(watcher, "scorer", "a", execution_s=4.0)
    end(watcher, "writer", "a", execution_s=4.0)
    assert watcher.gpu_s("scorer", "h20") == pytest.approx(4.0 / H20_COMPUTE)  # compute-bound: ~6.7x slower
    assert watcher.gpu_s("writer", "h20") == pytest.approx(4.0 / H20_MEMORY)  # memory-bound: faster on H20
    assert watcher.gpu_s("other", "h20") == pytest.approx(PRIOR_GPU_S / H20_COMPUTE)  # no bound given: compute
    # learned on H20 only: the reference figure is brought back by the same ratio
    only_h20 = demand()
    end(only_h20, "scorer", "b", execution_s=10.0)
    assert only_h20.reference_gpu_s("scorer") == pytest.approx(10.0 * H20_COMPUTE)
    assert only_h20.gpu_s("scorer", "h100") == pytest.approx(10.0 * H20_COMPUTE)
    assert only_h20.speed("scorer", "h20") == pytest.approx(H20_COMPUTE)


def test_speed_comes_from_measurements_where_both_types_were_measured() -> None:
    """Measured 4 GPU-s on H100 and 8 on H20: H20 is half as fast, whatever the prior (0.15) says."""
    watcher = demand()
    end(watcher, "scorer", "a", execution_s=4.0)
    end(watcher, "scorer", "b", execution_s=8.0)
    assert watcher.speed("scorer", "h20") == pytest.approx(0.5)
    assert watcher.speed("scorer", "h100") == 1.0
    assert watcher.speed("writer", "h20") == pytest.approx(H20_MEMORY)  # nothing measured: the prior


def test_load_is_the_rate_times_reference_gpu_seconds() -> None:
    watcher = demand(window_s=60.0)
    now = arrive(watcher, "scorer", 2.0, 0.0, 300.0)
    assert watcher.load("scorer", now) == pytest.approx(watcher.rate("scorer", now) * PRIOR_GPU_S)
    end(watcher, "scorer", "a", execution_s=3.0, gpus=2)
    assert watcher.load("scorer", now) == pytest.approx(watcher.rate("scorer", now) * 6.0)
    assert watcher.load("scorer", now) == pytest.approx(12.0, rel=0.01)
    assert watcher.load("writer", now) == 0.0


def test_only_generating_is_memory_bound() -> None:
    assert bound_of("generate") == "memory"
    assert {bound_of(task) for task in TASKS if task != "generate"} == {"compute"}
