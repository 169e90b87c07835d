"""The sensitivity scenario: AI coding at batch 1,280 with one assumption varied at a time (``TRIED``), so that a
headline figure comes with how the assumptions that decide it move it. The values tried are data of their own, apart
from the coding scenarios that run at the defaults.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from managers.cpu.config import CpuConfig
from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.assumptions import Assumptions
from tangram.sim.cluster import Costs
from tangram.sim.engine import simulate
from tangram.sim.policies import broker
from tangram.sim.scenario_common import (
    NONE_ASSUMED,
    Outcome,
    Point,
    Progress,
    cpu_cluster,
    figure,
    run_policies,
    to_stderr,
)
from tangram.sim.workloads import CodingParams, ai_coding

Variation = tuple[str, str, dict[str, Any], dict[str, Any], float | None]

#: the values tried for each assumption, defaults among them: (name, value label, workload params, costs, the CPU
#: manager's worker overhead share)
TRIED: tuple[Variation, ...] = (
    *(("test runner", runner, {}, {"test_runner": runner}, None) for runner in ("tangram", "xdist")),
    *(("runner cost, share of the suite", f"{x:.0%}", {}, {"runner_share": x}, None) for x in (0.0, 0.03, 0.12)),
    # under xdist: each worker collects the suite (the five measured suites' least and most; their median is the
    # "test runner = xdist" row), and the model before that calibration
    *(("xdist start-up per worker, share of the suite", f"{x:.1%}", {},
       {"test_runner": "xdist", "xdist_worker_share": x}, None) for x in (0.012, 0.27)),
    ("test-run model", "xdist before calibration (0.05 s + 0.22 s per worker)", {},
     {"test_runner": "xdist", "xdist_start_cpu_s": 0.05, "xdist_worker_cpu_s": 0.22, "xdist_worker_share": 0.0},
     None),
    *(("sandbox creation", f"{s:.1f} s", {}, {"env_create_s": s}, None) for s in (0.4, 1.0, 2.0)),
    *(("test-run serial fraction", f"{low:.0%}-{high:.0%}", {"serial_low": low, "serial_high": high}, {}, None)
      for low, high in ((0.0, 0.02), (0.01, 0.10), (0.05, 0.25))),
    *(("profiled T1 error (sigma)", f"{e:g}", {"profile_error": e}, {}, None) for e in (0.0, 0.25, 0.5)),
    *(("test-run T1 median", f"{t:g} s", {"test_median_s": t}, {}, None) for t in (5.0, 20.0, 60.0)),
    # how many xdist workers a malleable run starts beyond its cores (the runner's follow its cores instead)
    *(("xdist workers' start-up share", f"{x:.0%}", {}, {"test_runner": "xdist"}, x) for x in (0.02, 0.05, 0.1, 0.2)),
)


def _is_default(variation: Variation) -> bool:
    """Whether a tried value is what the simulator assumes now: then it is the defaults row, not a variation."""
    _, _, params, costs, overhead = variation
    return (all(getattr(CodingParams(), k) == v for k, v in params.items())
            and all(getattr(Costs(), k) == v for k, v in costs.items())
            and overhead in (None, CpuConfig.worker_overhead))


#: one assumption varied at a time from its default (the defaults' own values are the defaults row, whatever the
#: defaults are now)
VARIATIONS: tuple[Variation, ...] = tuple(v for v in TRIED if not _is_default(v))
#: the fixed DoPs the sensitivity scenario compares with (DoP 1 and 32 are never best at batch 1,280)
SENSITIVITY_DOPS = ("dop2", "dop4", "dop8", "dop16")


def sensitivity(scale: float, seed: int, progress: Progress = to_stderr,
                assumed: Assumptions = NONE_ASSUMED, profile: SchedulerProfile = DEFAULT_PROFILE) -> Outcome:
    """AI coding at batch 1,280 on 1,280 cores with one assumption varied at a time: best fixed DoP / ours and
    pods-ideal / ours, so a headline figure comes with how the assumptions that decide it move it."""
    points: list[Point] = []
    out = Outcome("sensitivity", "AI coding at batch 1,280: the margins under varied assumptions",
                  "assumption varied (one at a time)", points, [],
                  [f"best fixed DoP among {', '.join(SENSITIVITY_DOPS)}",
                   *(f"default {v[0]}: {v[1]}" for v in TRIED if _is_default(v))])
    batch = round(1280 * scale)
    for index, (name, label, params, costs, overhead) in enumerate((("defaults", "-", {}, {}, None), *VARIATIONS)):
        out.notes.append(f"x = {index}: {name} = {label}")
        cluster = cpu_cluster(round(1280 * scale), scale, assumed)
        cluster = replace(cluster, costs=replace(cluster.costs, **costs))
        trace = ai_coding(assumed.coding(batch=batch, **params), seed)
        ours = broker(profile) if overhead is None else broker(profile, worker_overhead=overhead)
        summary = simulate(trace, cluster, ours, "tangram").summary()
        points.append(Point(index, "tangram", summary))
        progress(f"sensitivity {name} {label}: ours {summary['mean_trajectory_act_s']:.2f} s")
        run_policies(trace, cluster, (*SENSITIVITY_DOPS, "pods-ideal"), index, points, progress,
                     f"sensitivity {index:2d}", profile)
        best = min(SENSITIVITY_DOPS, key=lambda policy: out.act(policy, index))
        out.figures += [
            figure(f"{name} = {label}: best fixed DoP / ours", None, out.act(best, index) / out.act("tangram", index),
                   f"best fixed: {best}"),
            figure(f"{name} = {label}: pods-ideal / ours", None,
                   out.act("pods-ideal", index) / out.act("tangram", index))]
    return out
