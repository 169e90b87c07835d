"""``tangram simulate`` and ``tangram trace``: every scenario runs end to end (scaled down) and writes its files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tangram.cli import main
from tangram.config import load_config
from tangram.sched.cycle import Cycle
from tangram.sim import broker_station, coding_scenarios, sensitivity
from tangram.sim.cluster import Costs
from tangram.sim.scenario_common import NONE_ASSUMED, cpu_cluster
from tangram.sim.scenarios import SCENARIOS
from tangram.sim.sensitivity import SENSITIVITY_DOPS, TRIED, VARIATIONS
from tangram.sim.workloads import CodingParams

pytestmark = pytest.mark.slow  # each scenario simulated end to end

#: the smallest scale that keeps the paper's node density (one CPU node of 256 cores)
QUICK = "0.2"
#: scenarios with a test of their own below, which also checks what every scenario writes
#: (training: tests/test_sim_training.py, gpu-slo: tests/test_sim_slo.py, partitions: tests/test_sim_partitions.py)
CHECKED_BELOW = ("coding-batch", "coding-capacity", "dop", "sensitivity", "training", "gpu-slo", "partitions")


def check_written(body: dict, scenario: str, out_png: Path) -> None:
    """What every scenario writes: figures against the paper's, points of each policy, a PNG."""
    assert body["scenario"] == scenario and body["scale"] == float(QUICK)
    assert body["figures"], "every scenario compares figures with the paper"
    for figure in body["figures"]:
        assert figure["ours"] >= 0
        if isinstance(figure["paper"], (int, float)):
            assert figure["ours_over_paper"] == pytest.approx(figure["ours"] / figure["paper"], rel=0.02, abs=2e-3)
    points = body["points"] if "points" in body else [p for run in body["runs"] for p in run["points"]]  # seeds
    policies = {p["policy"] for p in points}
    assert "tangram" in policies and len(policies) >= (1 if scenario == "breakdown" else 2)
    for point in points:
        assert point["failed_calls"] == 0 or point["policy"] == "baseline"
        assert point["calls"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - set(CHECKED_BELOW)))
def test_each_scenario_writes_figures_json_and_a_png(scenario, tmp_path, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["simulate", scenario, "--scale", QUICK, "--json", str(out_json), "--plot", str(out_png)]) == 0
    check_written(json.loads(out_json.read_text()), scenario, out_png)
    assert "paper" in capsys.readouterr().out


def test_a_scale_that_cannot_keep_the_node_density_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["simulate", "dop", "--scale", "0.1"])
    assert refused.value.code == 2 and "multiple of 1/5" in capsys.readouterr().err
    quick = cpu_cluster(round(1280 * 0.2), 0.2, NONE_ASSUMED)  # one node of full density...
    full = cpu_cluster(1280, 1.0, NONE_ASSUMED)
    assert (quick.cpu_nodes, quick.cores_per_node) == (1, full.cores_per_node) == (1, 256)
    assert quick.costs.pod_bind_per_s == pytest.approx(full.costs.pod_bind_per_s / 5)  # ... binding a fifth


#: the batches the dop test runs (all six take minutes): the smallest, and the two its named figures read
DOP_BATCHES = (128, 256, 1280)


def test_dop_compares_every_fixed_dop_over_seeds(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(coding_scenarios, "CODING_BATCHES", DOP_BATCHES)
    out_json, out_png = tmp_path / "dop.json", tmp_path / "dop.png"
    assert main(["simulate", "dop", "--scale", QUICK, "--seeds", "1,2", "--json", str(out_json),
                 "--plot", str(out_png)]) == 0
    body = json.loads(out_json.read_text())
    check_written(body, "dop", out_png)
    assert body["seeds"] == [1, 2] and [run["seed"] for run in body["runs"]] == [1, 2]
    runs = body["runs"]
    batches = sorted({p["x"] for p in runs[0]["points"]})
    policies = {p["policy"] for p in runs[0]["points"]}
    assert {f"dop{d}" for d in (1, 2, 4, 8, 16, 32)} | {"tangram", "tangram-paper"} <= policies
    best = [f for f in body["figures"] if f["name"].startswith("best fixed DoP / ours")]
    assert batches == [round(b * float(QUICK)) for b in DOP_BATCHES] and len(best) == len(batches)
    for batch, figure in zip(batches, best):
        assert figure["name"].endswith(f"batch {int(batch)}")
        per_seed = []
        for run in runs:  # each seed's figure is what its points say, and names the best DoP
            acts = {p["policy"]: p["mean_trajectory_act_s"] for p in run["points"] if p["x"] == batch}
            fixed = min((f"dop{d}" for d in (1, 2, 4, 8, 16, 32)), key=acts.__getitem__)
            own = next(f for f in run["figures"] if f["name"] == figure["name"])
            assert "over_seeds" not in own and own["note"] == f"best fixed: {fixed}"
            assert own["ours"] == pytest.approx(acts[fixed] / acts["tangram"], abs=1e-3)
            per_seed.append(own["ours"])
        assert figure["over_seeds"] == {"seeds": [1, 2], "min": min(per_seed), "max": max(per_seed),
                                        "median": pytest.approx(sum(per_seed) / 2, abs=1e-3)}
        assert figure["ours"] == figure["over_seeds"]["median"]
    spreads = [f["over_seeds"] for f in body["figures"]]
    assert any(s["min"] < s["max"] for s in spreads), "two seeds, two traces: some figure differs"
    named = {f["name"] for f in body["figures"]}
    assert {"tool-call mean queueing (s) at batch 1,280", "DoP 4 / elastic ACT at batch 256",
            "DoP 16 / elastic ACT at batch 1,280", "paper's moldable allocation / ours ACT at batch 1,280"} <= named
    printed = capsys.readouterr()
    assert printed.err.count("dop batch") == 2 * len(batches) * len(policies), "a progress line per run and seed"
    first = best[0]["over_seeds"]
    # the median and its range (rich may wrap them onto two lines of the cell)
    assert f"{first['median']:#.3g}" in printed.out and f"({first['min']:#.3g}–{first['max']:#.3g})" in printed.out


def test_simulate_runs_the_scheduler_profile_of_a_config_file_and_names_it(tmp_path, monkeypatch, capsys):
    """``--config``: the broker's policies build their cycles from the file's ``[scheduler]``, and the output says
    which; a file the broker would refuse is refused here too."""
    monkeypatch.setattr(coding_scenarios, "CODING_BATCHES", (128,))
    built: list[Cycle] = []

    class Recorded(Cycle):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(broker_station, "Cycle", Recorded)
    config = tmp_path / "broker.toml"
    config.write_text('[scheduler]\nqueue_order = "hrrs"\n[scheduler.elastic]\nhorizon = 16\n')
    out_json = tmp_path / "coding-batch.json"
    assert main(["simulate", "coding-batch", "--scale", QUICK, "--config", str(config), "--json", str(out_json)]) == 0
    profile = json.loads(out_json.read_text())["profile"]
    assert profile == {"config": str(config), **load_config(config).scheduler.to_json()}
    assert profile["queue_order"] == "hrrs" and profile["elastic"]["horizon"] == 16
    assert built and all(c.setup_order is not None and c.setup_order.resources == {"cpu"} for c in built)
    assert all(c.scheduler.horizon == 16 for c in built)
    assert "scheduler profile: [scheduler] of" in capsys.readouterr().out
    config.write_text('[scheduler]\norder = {cpu = "hrrs"}\n')
    assert main(["simulate", "coding-batch", "--scale", QUICK, "--config", str(config)]) == 2
    assert "now [scheduler] queue_order_by_resource" in capsys.readouterr().err


def test_coding_scenarios_set_the_broker_beside_ideal_pods(tmp_path, monkeypatch):
    monkeypatch.setattr(coding_scenarios, "CODING_BATCHES", (128, 512))  # two of each, not six and five: minutes
    monkeypatch.setattr(coding_scenarios, "CODING_CAPACITIES", (768, 1280))
    for scenario in ("coding-batch", "coding-capacity"):
        out_json, out_png = tmp_path / f"{scenario}.json", tmp_path / f"{scenario}.png"
        assert main(["simulate", scenario, "--scale", QUICK, "--json", str(out_json), "--plot", str(out_png)]) == 0
        body = json.loads(out_json.read_text())
        check_written(body, scenario, out_png)
        xs = {p["x"] for p in body["points"]}
        ideal = {p["x"]: p for p in body["points"] if p["policy"] == "pods-ideal"}
        assert set(ideal) == xs and len(xs) == 2
        ratios = [f for f in body["figures"] if f["name"].startswith("pods-ideal / broker")]
        assert len(ratios) == len(xs)
        for point in ideal.values():  # no control plane: no pod waits to be bound
            assert point["by_kind"]["tool"]["mean_queue_s"] == pytest.approx(0.0, abs=1e-9)
        if scenario == "coding-batch":  # no schedule beats every call at its fastest with none waiting
            figures = {f["name"]: f["ours"] for f in body["figures"]}
            for x in xs:
                assert (figures[f"pods-ideal / unqueued ACT, batch {int(x)}"]
                        >= figures[f"pods-ideal / broker ACT, batch {int(x)}"])


#: the sensitivity rows the end-to-end test runs (all of them take minutes): one of each kind of variation
#: (a cost, a workload parameter, the runner, the CPU manager's worker rule), and those its assertions read
SENSITIVITY_RUN = {("test runner", "xdist"), ("runner cost, share of the suite", "12%"),
                   ("xdist start-up per worker, share of the suite", "27.0%"), ("sandbox creation", "2.0 s"),
                   ("test-run T1 median", "60 s"), ("xdist workers' start-up share", "2%"),
                   ("xdist workers' start-up share", "20%")}


def test_every_tried_assumption_names_real_fields_and_is_one_row():
    """What the end-to-end test below leaves out still builds: each variation sets fields that exist to values
    their dataclasses accept, and names a row of its own."""
    assert SENSITIVITY_RUN <= {(name, label) for name, label, *_ in VARIATIONS}
    assert len({(name, label) for name, label, *_ in TRIED}) == len(TRIED)
    for name, label, params, costs, overhead in VARIATIONS:
        CodingParams(**params)
        Costs(**costs)
        assert overhead is None or 0 <= overhead < 1, (name, label)
        assert params or costs or overhead is not None, f"{name} = {label} varies nothing"
    assert len(VARIATIONS) < len(TRIED), "the defaults' own values are the defaults row"


def test_sensitivity_varies_one_assumption_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(sensitivity, "VARIATIONS",
                        tuple(v for v in VARIATIONS if (v[0], v[1]) in SENSITIVITY_RUN))
    out_json, out_png = tmp_path / "sensitivity.json", tmp_path / "sensitivity.png"
    assert main(["simulate", "sensitivity", "--scale", QUICK, "--json", str(out_json), "--plot", str(out_png)]) == 0
    body = json.loads(out_json.read_text())
    check_written(body, "sensitivity", out_png)
    acts: dict[tuple[int, str], float] = {(p["x"], p["policy"]): p["mean_trajectory_act_s"] for p in body["points"]}
    rows = [("defaults", "-"), *((name, label) for name, label, *_ in sensitivity.VARIATIONS)]
    assert len(rows) == len(SENSITIVITY_RUN) + 1
    assert set(acts) == {(i, policy) for i in range(len(rows))
                         for policy in ("tangram", *SENSITIVITY_DOPS, "pods-ideal")}
    figures = {f["name"]: f for f in body["figures"]}
    assert len(figures) == 2 * len(rows)
    for i, (name, label) in enumerate(rows):
        best = figures[f"{name} = {label}: best fixed DoP / ours"]
        fixed = min(SENSITIVITY_DOPS, key=lambda policy: acts[i, policy])
        assert best["paper"] is None and best["note"] == f"best fixed: {fixed}"
        assert best["ours"] == pytest.approx(acts[i, fixed] / acts[i, "tangram"], abs=1e-3)
        ideal = figures[f"{name} = {label}: pods-ideal / ours"]
        assert ideal["ours"] == pytest.approx(acts[i, "pods-ideal"] / acts[i, "tangram"], abs=1e-3)
    row = {label_of: i for i, label_of in enumerate(rows)}
    slow_workers = row["xdist start-up per worker, share of the suite", "27.0%"]  # fixed DoPs and pods pay too
    assert acts[slow_workers, "dop4"] > acts[0, "dop4"] and acts[slow_workers, "pods-ideal"] > acts[0, "pods-ideal"]
    assert acts[row["sandbox creation", "2.0 s"], "tangram"] > acts[0, "tangram"]
    assert acts[row["test-run T1 median", "60 s"], "dop8"] > acts[0, "dop8"]
    xdist = row["test runner", "xdist"]
    assert acts[xdist, "dop4"] > acts[0, "dop4"], "xdist's workers each collect the suite; the runner's do not"
    assert acts[row["runner cost, share of the suite", "12%"], "dop4"] > acts[0, "dop4"]
    shares = [i for (name, _), i in row.items() if name == "xdist workers' start-up share"]
    assert len(shares) == 2
    for i in shares:  # the worker rule is the broker's: nothing else moves (against xdist at the default share)
        assert all(acts[i, policy] == acts[xdist, policy] for policy in (*SENSITIVITY_DOPS, "pods-ideal"))
    assert any(acts[i, "tangram"] != acts[xdist, "tangram"] for i in shares), "the share reaches the broker"


def test_trace_make_then_run_under_two_policies(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["trace", "make", "ai_coding", "--batch", "12", "--seed", "4", "--out", str(trace)]) == 0
    report = tmp_path / "r.json"
    assert main(["trace", "run", str(trace), "--policy", "tangram", "--policy", "dop4", "--cores", "80",
                 "--json", str(report)]) == 0
    rows = json.loads(report.read_text())
    assert [r["policy"] for r in rows] == ["tangram", "dop4"]
    calls = sum(len(t["calls"]) for t in json.loads(trace.read_text())["trajectories"])
    assert rows[0]["calls"] == rows[1]["calls"] == calls
    assert rows[1]["by_kind"]["test"]["mean_units"] == 4


def test_trace_run_refuses_a_cluster_without_the_resources_the_trace_needs(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["trace", "make", "mopd", "--batch", "3", "--out", str(trace)]) == 0
    assert main(["trace", "run", str(trace), "--gpus", "0"]) == 2
    assert "--gpus" in capsys.readouterr().err


def test_trace_run_simulates_the_cluster_a_config_deploys(tmp_path, capsys):
    """``--config`` without a shape flag: the file's CPU nodes, GPU nodes and services are the simulated cluster
    (the rows say so); a shape flag still wins; what the simulator cannot model is refused naming the key."""
    coding, mopd = tmp_path / "coding.json", tmp_path / "mopd.json"
    assert main(["trace", "make", "ai_coding", "--batch", "12", "--seed", "4", "--out", str(coding)]) == 0
    assert main(["trace", "make", "mopd", "--batch", "3", "--out", str(mopd)]) == 0
    config, report = tmp_path / "broker.toml", tmp_path / "r.json"
    cpu_nodes = "".join(f'[cpu.nodes.n{i}]\ncores = [0, 1, 2, 3, 4, 5]\nmemory_mb = 65536\n' for i in range(3))
    config.write_text('[scheduler]\nqueue_order = "hrrs"\n' + cpu_nodes)
    assert main(["trace", "run", str(coding), "--policy", "tangram", "--config", str(config),
                 "--json", str(report)]) == 0
    row = json.loads(report.read_text())[0]
    assert row["cluster"]["source"] == f"deployed by {config}" and row["profile"]["queue_order"] == "hrrs"
    assert (row["cluster"]["cpu_nodes"], row["cluster"]["cores_per_node"]) == (3, 6)
    assert row["calls"] == sum(len(t["calls"]) for t in json.loads(coding.read_text())["trajectories"])
    assert main(["trace", "run", str(coding), "--policy", "tangram", "--config", str(config), "--cores", "80",
                 "--json", str(report)]) == 0
    assert json.loads(report.read_text())[0]["cluster"]["source"] == "--cores 80 --cpu-nodes 5 --gpus 40"

    config.write_text(cpu_nodes + '[cpu.nodes.big]\ncores = [0, 1, 2, 3, 4, 5, 6, 7]\nmemory_mb = 65536\n')
    capsys.readouterr()
    assert main(["trace", "run", str(coding), "--config", str(config)]) == 2
    assert "cpu.nodes.big.cores: 8 cores, where cpu.nodes.n0.cores has 6" in capsys.readouterr().err

    gpu_nodes = "".join(f'[gpu.nodes.g{i}]\ngpus = 4\ngpu_memory_mb = 40960\nhost_memory_mb = 100000\n'
                        f'device_type = "cpu"\ntype = "{kind}"\n' for i, kind in enumerate(("h100", "h20")))
    teacher = 'backend = "sglang"\nmodel = "m"\ntask = "score"\ngpu_memory_mb = 20480\nhost_memory_mb = 16384\n'
    config.write_text('[cpu]\nenabled = false\n' + gpu_nodes + f'[gpu.services.teacher0]\n{teacher}')
    assert main(["trace", "run", str(mopd), "--config", str(config)]) == 2
    assert "gpu.services: the trace calls reward service 'teacher4'; the config serves ['teacher0']" in \
        capsys.readouterr().err
    config.write_text(config.read_text() + f'dops = [1, 2]\n[gpu.services.teacher4]\n{teacher}')
    assert main(["trace", "run", str(mopd), "--config", str(config), "--json", str(report)]) == 0
    rows = json.loads(report.read_text())
    assert [r["policy"] for r in rows] == ["tangram", "baseline"]
    assert rows[0]["cluster"] | {"source": None} == {
        "source": None, "cpu_nodes": 0, "cores_per_node": 256, "gpu_nodes": [4, 4], "gpu_node_types": ["h100", "h20"],
        "services": ["teacher0", "teacher4"], "apis": []}
    assert all(r["failed_calls"] == 0 and r["calls"] == 3 for r in rows)
