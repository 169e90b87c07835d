"""PNG plots of a scenario's outcome (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from tangram.sim.scenario_common import Outcome

#: fixed DoPs in one sequential palette, light (DoP 1) to dark (DoP 32)
DOP_SHADES = {"dop1": "#fdd0a2", "dop2": "#fdae6b", "dop4": "#fd8d3c", "dop8": "#f16913", "dop16": "#d94801",
              "dop32": "#8c2d04"}
COLORS = {"tangram": "#1f77b4", "baseline": "#d62728", "pods-ideal": "#e377c2", "tangram-min4": "#9467bd",
          "tangram-paper": "#7f7f7f", "tangram-moldable": "#bcbd22", "tangram-srpt": "#17becf", "serverless": "#2ca02c",
          "tangram-typed": "#ff7f0e", "tangram-live": "#2ca02c", "tangram-placed": "#9467bd", "tangram-greedy": "#8c564b",
          **DOP_SHADES}
LABELS = {"tangram": "ARL-Tangram (malleable, simulated)", "baseline": "pods", "pods-ideal": "pods, free control plane",
          "tangram-min4": "elastic DoP 4-32 (moldable)", "tangram-paper": "paper's algorithm (moldable)",
          "tangram-moldable": "moldable + arrivals", "tangram-srpt": "malleable, by remaining work",
          "serverless": "ServerlessLLM-style (on demand, fixed DoP)",
          "tangram-typed": "typed fit, no placement", "tangram-live": "typed fit + placement from measured demand",
          "tangram-placed": "typed fit + ILP placement from the trace (oracle)",
          "tangram-greedy": "typed fit + greedy placement from the trace (oracle)",
          **{name: f"fixed DoP {name[3:]}" for name in DOP_SHADES}}


#: what the ``baseline`` policy is for each workload of a series plot
SERIES_BASELINES = {"AI coding": "pods", "MOPD": "static deployment",
                    "DeepSearch": "direct API calls, static judge"}


def plot(outcome: Outcome, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if outcome.series:
        _series(outcome, path)
        return
    bars = outcome.scenario in ("breakdown", "e2e", "gpu-slo")
    named = {} if bars else _x_labels(outcome)  # unrelated settings (sensitivity): markers only, each x named
    figure, axes = plt.subplots(figsize=(9, 5) if named else (7, 4.2), dpi=110)
    if bars:
        _bars(outcome, axes)
    else:
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for point in outcome.points:
            series[point.policy].append((point.x, point.summary["mean_trajectory_act_s"]))
        for policy, values in series.items():
            xs, ys = zip(*sorted(values))
            axes.plot(xs, ys, marker="o", linestyle="none" if named else "-", color=COLORS.get(policy),
                      label=LABELS.get(policy, policy))
        if named:
            axes.set_xticks(list(named), list(named.values()), rotation=60, ha="right", fontsize=7)
        axes.set_xlabel(outcome.x_label)
        axes.set_ylabel("mean ACT per trajectory (s)")
        axes.set_yscale("log")
        axes.legend(**({"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8} if named else {}))
    axes.set_title(outcome.title, fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _series(outcome: Outcome, path: str | Path) -> None:
    """One panel per workload: each policy's mean ACT per time window over the run (Fig. 6), log scale."""
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(name.partition("/")[0] for name in outcome.series))
    figure, panels = plt.subplots(len(workloads), 1, figsize=(7, 2.6 * len(workloads)), dpi=110, squeeze=False)
    for axes, workload in zip(panels[:, 0], workloads):
        for name, rows in outcome.series.items():
            label, _, policy = name.partition("/")
            if label == workload and rows:
                axes.plot([row[0] / 60 for row in rows], [math.nan if row[1] is None else row[1] for row in rows],
                          color=COLORS.get(policy), linewidth=1,
                          label=SERIES_BASELINES.get(workload, "baseline") if policy == "baseline"
                          else LABELS.get(policy, policy))
        axes.set_title(workload, fontsize=9)
        axes.set_ylabel("mean ACT (s)")
        axes.set_yscale("log")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, loc="upper right")
    panels[-1, 0].set_xlabel("time since training started (min)")
    figure.suptitle(outcome.title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _x_labels(outcome: Outcome) -> dict[int, str]:
    """The names a scenario gives its x values in its notes (``x = 3: label``), when they are not a scale."""
    return {int(x[4:]): label for x, _, label in (note.partition(": ") for note in outcome.notes)
            if x.startswith("x = ")}


def _bars(outcome: Outcome, axes: object) -> None:
    if outcome.scenario == "gpu-slo":  # tasks each admission put on the pool, each bar labelled with its attainment
        names = [p.policy for p in outcome.points]
        bars = axes.bar(names, [p.summary["tasks"] for p in outcome.points],  # type: ignore[attr-defined]
                        label="tasks admitted")
        axes.bar_label(bars, [f"{p.summary['attainment']:.0%} within SLO"  # type: ignore[attr-defined]
                              for p in outcome.points], fontsize=8)
        axes.set_ylabel("tasks on the 40 GPUs")  # type: ignore[attr-defined]
    elif outcome.scenario == "breakdown":
        names = [f"{'Coding' if i < 2 else 'MOPD'} ({int(p.x)})" for i, p in enumerate(outcome.points)]
        bottom = [0.0] * len(names)
        for key, label in (("mean_exec_s", "execution"), ("mean_queue_s", "queueing"),
                           ("mean_overhead_s", "system overhead")):
            values = [p.summary[key] for p in outcome.points]
            axes.bar(names, values, bottom=bottom, label=label)  # type: ignore[attr-defined]
            bottom = [b + v for b, v in zip(bottom, values)]
        axes.set_ylabel("mean seconds per call")  # type: ignore[attr-defined]
        axes.set_yscale("symlog", linthresh=1.0)  # type: ignore[attr-defined]
    else:
        labels = list(_x_labels(outcome).values())
        width = 0.38
        for offset, policy in ((-width / 2, "tangram"), (width / 2, "baseline")):
            values = [outcome.act(policy, x) for x in range(len(labels))]
            axes.bar([x + offset for x in range(len(labels))], values, width,  # type: ignore[attr-defined]
                     color=COLORS[policy], label=LABELS[policy])
        axes.set_xticks(range(len(labels)), labels)  # type: ignore[attr-defined]
        axes.set_ylabel("mean ACT per trajectory (s)")  # type: ignore[attr-defined]
        axes.set_yscale("log")  # type: ignore[attr-defined]
    axes.legend()  # type: ignore[attr-defined]
