"""``tangram simulate`` and ``tangram trace``: every scenario runs end to end (scaled down) and writes its files."""

from __future__ import annotations

import json

import pytest

from tangram.cli import main
from tangram.sim.scenarios import SCENARIOS


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_scenario_writes_figures_json_and_a_png(scenario, tmp_path, capsys):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["simulate", scenario, "--scale", "0.02", "--json", str(out_json), "--plot", str(out_png)]) == 0
    body = json.loads(out_json.read_text())
    assert body["scenario"] == scenario and body["scale"] == 0.02
    assert body["figures"], "every scenario compares figures with the paper"
    for figure in body["figures"]:
        assert figure["ours"] >= 0
        if isinstance(figure["paper"], (int, float)):
            assert figure["ours_over_paper"] == pytest.approx(figure["ours"] / figure["paper"], rel=0.02, abs=2e-3)
    policies = {p["policy"] for p in body["points"]}
    assert "tangram" in policies and len(policies) >= (1 if scenario == "breakdown" else 2)
    for point in body["points"]:
        assert point["failed_calls"] == 0 or point["policy"] == "baseline"
        assert point["calls"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "paper" in capsys.readouterr().out


def test_dop_compares_every_fixed_dop_over_seeds(tmp_path, capsys):
    out_json = tmp_path / "dop.json"
    assert main(["simulate", "dop", "--scale", "0.02", "--seeds", "1,2", "--json", str(out_json)]) == 0
    body = json.loads(out_json.read_text())
    assert body["seeds"] == [1, 2] and [run["seed"] for run in body["runs"]] == [1, 2]
    batches = sorted({p["x"] for p in body["points"]})
    policies = {p["policy"] for p in body["points"]}
    assert {f"dop{d}" for d in (1, 2, 4, 8, 16, 32)} | {"tangram", "tangram-paper"} <= policies
    best = {f["name"]: f for f in body["figures"] if f["name"].startswith("best fixed DoP / ours")}
    assert len(best) == len(batches) == 6
    for batch, figure in zip(batches, best.values()):
        spread = figure["over_seeds"]
        assert spread["min"] - 1e-3 <= spread["median"] == figure["ours"] <= spread["max"] + 1e-3
        per_seed = []
        for run in body["runs"]:  # the figure is what the points say, for each seed
            acts = {p["policy"]: p["mean_trajectory_act_s"] for p in run["points"] if p["x"] == batch}
            per_seed.append(min(acts[f"dop{d}"] for d in (1, 2, 4, 8, 16, 32)) / acts["tangram"])
        assert sorted(per_seed) == pytest.approx([spread["min"], spread["max"]], abs=2e-3)
    assert "median" not in capsys.readouterr().err


def test_coding_scenarios_set_the_broker_beside_ideal_pods(tmp_path):
    for scenario in ("coding-batch", "coding-capacity"):
        out_json = tmp_path / f"{scenario}.json"
        assert main(["simulate", scenario, "--scale", "0.02", "--json", str(out_json)]) == 0
        body = json.loads(out_json.read_text())
        xs = {p["x"] for p in body["points"]}
        ideal = {p["x"]: p for p in body["points"] if p["policy"] == "pods-ideal"}
        assert set(ideal) == xs
        ratios = [f for f in body["figures"] if f["name"].startswith("pods-ideal / broker")]
        assert len(ratios) == len(xs)
        for point in ideal.values():  # no control plane: no pod waits to be bound
            assert point["by_kind"]["tool"]["mean_queue_s"] == pytest.approx(0.0, abs=1e-9)


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
