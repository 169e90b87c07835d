"""``tangram simulate`` and ``tangram trace``: the paper's scenarios, and saved traces run under any policy."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sim.assumptions import parse
from tangram.sim.cluster import Cluster, ServiceModel, gpu_nodes
from tangram.sim.deployment import Deployment, NotSimulable, deployed_cluster
from tangram.sim.engine import simulate
from tangram.sim.policies import POLICIES, named_policies
from tangram.sim.scenario_common import JUDGE, Outcome, check_scale, search_api
from tangram.sim.scenarios import SCENARIOS
from tangram.sim.trace import Trace
from tangram.sim.workloads import CodingParams, MopdParams, SearchParams, ai_coding, deepsearch, mopd

#: reads a broker's config file and gives what it deploys (the CLI's, which validates the whole file)
DeploymentLoader = Callable[[str], Deployment]

WORKLOADS = {"ai_coding": lambda batch, seed: ai_coding(CodingParams(batch=batch), seed),
             "mopd": lambda batch, seed: mopd(MopdParams(batch=batch), seed),
             "deepsearch": lambda batch, seed: deepsearch(SearchParams(batch=batch), seed)}


def _table(outcome: Outcome, seeds: list[int]) -> Table:
    caption = f"ours: median (min–max) over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else None
    table = Table(title=outcome.title, caption=caption)
    for column in ("figure", "paper", "ours", "ours / paper", "note"):
        table.add_column(column, justify="left" if column in ("figure", "note") else "right")
    for f in outcome.figures:
        ratio = f["ours_over_paper"]
        spread = f.get("over_seeds")
        ours = f"{f['ours']:#.3g}" if spread is None else \
            f"{spread['median']:#.3g} ({spread['min']:#.3g}–{spread['max']:#.3g})"
        table.add_row(f["name"], "-" if f["paper"] is None else str(f["paper"]), ours,
                      "-" if ratio is None else f"{ratio:.2f}", f.get("note", ""))
    return table


def over_seeds(outcomes: list[Outcome], seeds: list[int]) -> Outcome:
    """The same scenario run under each seed, as one outcome whose figures are the median over the seeds, each
    with its spread in ``over_seeds`` (seeds, min, median, max); the runs' own figures are left as they were.
    Its points are the first seed's (what the plot shows)."""
    figures = []
    for figure in outcomes[0].figures:
        same = [next(f for f in o.figures if f["name"] == figure["name"]) for o in outcomes]
        values = [f["ours"] for f in same]
        notes = [f["note"] for f in same]
        middle = round(statistics.median(values), 3)
        paper = figure["paper"]
        figures.append({**figure, "ours": middle,
                        "ours_over_paper": round(middle / paper, 3) if isinstance(paper, (int, float)) and paper
                        else None,
                        "note": notes[0] if len(set(notes)) == 1 else
                        "; ".join(f"seed {seed}: {note}" for seed, note in zip(seeds, notes)),
                        "over_seeds": {"seeds": seeds, "min": min(values), "median": middle, "max": max(values)}})
    return replace(outcomes[0], figures=figures)


def _profile(deployment: Deployment | None, config: str | None) -> tuple[SchedulerProfile, dict[str, Any]]:
    """The scheduler profile of the ``--config`` file (the broker's defaults without one), and how the output
    names it."""
    profile = DEFAULT_PROFILE if deployment is None else deployment.profile
    return profile, {"config": config, **profile.to_json()}


def _simulate(load: DeploymentLoader, args: argparse.Namespace) -> int:
    """Run the scenarios with a progress bar over them (each run's summary line under it); on a console that is
    not a terminal (CI logs) the lines are printed instead."""
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    assumed = parse(args.set)  # each item was checked as it was read
    profile, named = _profile(None if args.config is None else load(args.config), args.config)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    console = Console()
    columns = (SpinnerColumn(), TextColumn("[bold]{task.description}", table_column=Column(min_width=15)),
               BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[line]}", style="dim",
                          table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)))
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        overall = bar.add_task("simulating", total=len(names), line="")

        def on_run(line: str) -> None:
            if console.is_terminal:
                bar.update(overall, line=line)
            else:
                print(line, file=sys.stderr, flush=True)

        seeds = args.seeds or [args.seed]
        for name in names:
            bar.update(overall, description=name)
            started = time.perf_counter()
            outcomes = [SCENARIOS[name](args.scale, seed, on_run, assumed, profile) for seed in seeds]
            wall_s = round(time.perf_counter() - started, 1)
            if len(seeds) == 1:
                outcome = outcomes[0]
                body: dict[str, Any] = {**outcome.to_json(), "scale": args.scale, "assumed": assumed.to_json(),
                                        "profile": named, "seed": seeds[0], "wall_s": wall_s}
            else:  # the aggregate's figures, and each seed's run as it would have been written alone
                outcome = over_seeds(outcomes, seeds)
                aggregate = {k: v for k, v in outcome.to_json().items() if k != "points"}
                body = {**aggregate, "scale": args.scale, "assumed": assumed.to_json(), "profile": named,
                        "seeds": seeds, "wall_s": wall_s,
                        "runs": [{**o.to_json(), "scale": args.scale, "seed": seed}
                                 for o, seed in zip(outcomes, seeds)]}
            json_path = args.json if args.json and len(names) == 1 else (Path(args.out) / f"{name}.json"
                                                                        if args.out else None)
            plot_path = args.plot if args.plot and len(names) == 1 else (Path(args.out) / f"{name}.png"
                                                                        if args.out else None)
            if json_path:
                Path(json_path).write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
            if plot_path:
                from tangram.sim.plot import plot

                plot(outcome, plot_path)
            bar.console.print(_table(outcome, seeds))
            if args.config:
                bar.console.print(f"scheduler profile: [scheduler] of {args.config}", markup=False)
            if assumed.overrides:
                bar.console.print(f"assumptions changed: {', '.join(f'{k} = {v}' for k, v in assumed.to_json().items())}")
            bar.console.print(f"{name}: {body['wall_s']} s wall" + (f", {json_path}" if json_path else "")
                              + (f", {plot_path}" if plot_path else ""))
            bar.advance(overall)
    return 0


def _trace_make(args: argparse.Namespace) -> int:
    trace = WORKLOADS[args.workload](args.batch, args.seed)
    trace.save(args.out)
    print(f"{args.out}: {len(trace.trajectories)} trajectories, {trace.calls} calls")
    return 0


def cluster_for(trace: Trace, cores: int, cpu_nodes: int, gpus: int) -> Cluster:
    """A cluster serving every call of ``trace``: its reward services (the judge as in §6.1, teachers on four
    GPUs each) and its APIs (the scenarios' quotas)."""
    targets = {c.target for t in trace.trajectories for c in t.calls if c.target}
    kinds = {c.kind for t in trace.trajectories for c in t.calls}
    services = tuple(JUDGE if name == "judge" else ServiceModel(name) for name in sorted(targets)
                     if not name.startswith("api."))
    apis = tuple(search_api(name) for name in sorted(targets) if name.startswith("api."))
    if {"tool", "test"} & kinds and cores < 1:
        raise ValueError("the trace has CPU calls: give --cores")
    if services and gpus < 1:
        raise ValueError("the trace has reward calls: give --gpus")
    return Cluster(cpu_nodes=cpu_nodes if cores else 0, cores_per_node=max(1, cores // max(1, cpu_nodes)),
                   gpu_node_sizes=gpu_nodes(gpus) if services else (), services=services, apis=apis)


#: the cluster ``trace run`` simulates when neither ``--config`` nor a shape flag gives one: the paper's (§6.1)
DEFAULT_SHAPE = {"cores": 1280, "cpu_nodes": 5, "gpus": 40}


def _trace_cluster(deployment: Deployment | None, args: argparse.Namespace, trace: Trace) -> tuple[Cluster, str]:
    """The cluster of the shape flags (the defaults for those left out), or the one ``--config`` deploys when no
    flag is given; and where it comes from."""
    flags = {name: getattr(args, name) for name in DEFAULT_SHAPE}
    if deployment is not None and all(value is None for value in flags.values()):
        return deployed_cluster(deployment, trace), f"deployed by {args.config}"
    shape = {name: DEFAULT_SHAPE[name] if value is None else value for name, value in flags.items()}
    return cluster_for(trace, **shape), "--cores {cores} --cpu-nodes {cpu_nodes} --gpus {gpus}".format(**shape)


def _trace_run(load: DeploymentLoader, args: argparse.Namespace) -> int:
    trace = Trace.load(args.trace)
    deployment = None if args.config is None else load(args.config)
    profile, named = _profile(deployment, args.config)
    try:
        cluster, source = _trace_cluster(deployment, args, trace)
    except NotSimulable as error:
        print(f"tangram: {args.config}: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"tangram: {error}", file=sys.stderr)
        return 2
    shape = {"source": source, "cpu_nodes": cluster.cpu_nodes, "cores_per_node": cluster.cores_per_node,
             "gpu_nodes": list(cluster.gpu_node_sizes), "gpu_node_types": list(cluster.gpu_node_types),
             "services": [service.name for service in cluster.services], "apis": [api.name for api in cluster.apis]}
    print(f"cluster ({source}): {cluster.cpu_nodes} CPU nodes of {cluster.cores_per_node} cores, GPU nodes "
          f"{list(cluster.gpu_node_sizes)}")
    rows = []
    policies = named_policies(profile)
    for policy in args.policy or ["tangram", "baseline"]:
        summary = simulate(trace, cluster, policies[policy], policy).summary()
        rows.append({**summary, "profile": named, "cluster": shape})
        print(f"{policy:>12}: mean ACT per trajectory {summary['mean_trajectory_act_s']:.2f} s, mean ACT "
              f"{summary['mean_act_s']:.3f} s, failed {summary['failed_calls']}, {summary['wall_s']:.1f} s wall")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 0


CONFIG_HELP = ("a broker's TOML config: the broker's policies run its [scheduler] profile (each variant changes only "
               "what its name says; an order for a resource the scenario lacks is unused); default: the broker's "
               "defaults")


TRACE_CONFIG_HELP = ("a broker's TOML config: its [scheduler] profile, and, unless --cores, --cpu-nodes or --gpus is "
                     "given, the cluster it deploys (its CPU and GPU nodes, reward services and [basic] APIs)")


def _assumption(text: str) -> str:
    try:
        parse([text])
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _scale(text: str) -> float:
    try:
        scale = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    try:
        check_scale(scale)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return scale


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be integers separated by commas, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    return seeds


def add_commands(commands: Any, load: DeploymentLoader) -> None:
    """``simulate`` and ``trace``; ``load`` reads ``--config``."""
    simulate_parser = commands.add_parser("simulate", help="reproduce one of the paper's evaluation scenarios in the "
                                                           "simulator (or all of them)")
    simulate_parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    simulate_parser.add_argument("--scale", type=_scale, default=1.0,
                                 help="multiply batch sizes and capacity by a multiple of 0.2: whole nodes of the "
                                      "paper's density (0.2 for a quick look); MOPD keeps its full size")
    simulate_parser.add_argument("--set", type=_assumption, action="append", default=[], metavar="GROUP.FIELD=VALUE",
                                 help="change an assumed parameter (repeatable): costs.*, coding.*, mopd.*, search.* "
                                      "or api.quota / api.concurrency (the search upstreams), e.g. "
                                      "costs.pod_bind_per_s=200 mopd.zipf=0")
    simulate_parser.add_argument("--seed", type=int, default=1)
    simulate_parser.add_argument("--seeds", type=_seed_list, help="run each scenario once per seed (e.g. 1,2,3) and "
                                                                   "report every figure's median and range")
    simulate_parser.add_argument("--json", help="write the figures and every point here")
    simulate_parser.add_argument("--plot", help="write a PNG plot here")
    simulate_parser.add_argument("--out", help="directory for SCENARIO.json and SCENARIO.png (with 'all')")
    simulate_parser.add_argument("--config", help=CONFIG_HELP)
    simulate_parser.set_defaults(func=partial(_simulate, load))

    trace = commands.add_parser("trace", help="make a workload trace, or run a saved one in the simulator")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True)
    make = trace_commands.add_parser("make", help="generate a trace and save it as JSON")
    make.add_argument("workload", choices=sorted(WORKLOADS))
    make.add_argument("--batch", type=int, required=True)
    make.add_argument("--seed", type=int, default=1)
    make.add_argument("--out", required=True)
    make.set_defaults(func=_trace_make)
    run = trace_commands.add_parser("run", help="simulate a saved trace under some policies")
    run.add_argument("trace")
    run.add_argument("--policy", action="append", choices=sorted(POLICIES), help="repeatable (default: tangram and "
                                                                                "baseline)")
    for flag, what in (("cores", "CPU cores in all"), ("cpu-nodes", "CPU nodes"), ("gpus", "GPUs in all")):
        run.add_argument(f"--{flag}", type=int, help=f"{what} (default {DEFAULT_SHAPE[flag.replace('-', '_')]}, or "
                                                     f"the cluster --config deploys when no shape flag is given)")
    run.add_argument("--json")
    run.add_argument("--config", help=TRACE_CONFIG_HELP)
    run.set_defaults(func=partial(_trace_run, load))
