"""``tangram`` command line: ``serve`` runs the broker, ``status`` shows a running one, ``token`` manages API tokens,
``image build`` makes the sandbox image, ``doctor`` and ``config check`` check a deployment before it serves,
``simulate`` and ``trace`` run the simulator."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tangram.config import load_config, with_ray
from tangram.core.errors import ConfigError
from tangram.log_format import LOG_FORMAT_ENV, LOG_FORMATS, configure_logging
from tangram.sim.commands import add_commands as add_simulation_commands
from tangram.sim.deployment import Deployment
from tangram.version import VERSION

#: ``--config``'s help where the file is optional and ``$TANGRAM_CONFIG`` stands in for it
CONFIG_OR_DEFAULTS = "TOML config file (default $TANGRAM_CONFIG or the defaults)"


def _serve(args: argparse.Namespace) -> int:
    from sandboxes.backend import SandboxError
    from tangram.service import run

    if args.log_format not in LOG_FORMATS:  # from the environment: argparse checks only the flag's value
        raise ConfigError(LOG_FORMAT_ENV, f"must be one of {list(LOG_FORMATS)}, not {args.log_format!r}")
    config = load_config(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **overrides))
    if args.ray is not None:
        config = with_ray(config, dataclasses.replace(config.cpu.ray, address=args.ray))
    configure_logging(args.log_format)
    try:
        run(config, insecure=args.insecure)
    except KeyboardInterrupt:
        pass
    except SandboxError as error:  # a CPU node that cannot start: its engine, image or run directory
        print(f"tangram: {error.message}", file=sys.stderr)
        return 1
    return 0


def _deployment(path: str) -> Deployment:
    """What a broker's config file deploys, for the simulator; the whole file is checked as ``serve`` checks it."""
    config = load_config(path)
    return Deployment(config.scheduler, config.cpu, config.gpu, config.basic)


def _config_check(args: argparse.Namespace) -> int:
    """The file parsed as ``serve`` parses it; a bad key raises ``ConfigError``, which ``main`` reports (exit 2)."""
    from tangram.doctor import config_summary

    config = load_config(args.config)
    print("ok")
    for line in config_summary(config):
        print(line)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from tangram.doctor import run_checks

    results = run_checks(args.config)
    if args.json:
        print(json.dumps([result.to_json() for result in results], indent=2))
    else:
        for result in results:
            print(result.line())
    return 1 if any(result.status == "FAIL" for result in results) else 0


def _fetch(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
        return json.loads(response.read())


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _utilization(in_use: int, capacity: int) -> Text:
    """A ten-cell bar and percentage, green below 70 %, yellow below 90 %, red above."""
    share = in_use / capacity if capacity else 0.0
    cells = round(share * 10)
    style = "green" if share < 0.7 else "yellow" if share < 0.9 else "red"
    return Text.assemble(("█" * cells, style), ("░" * (10 - cells), "dim"), f" {share:4.0%}")


def speedup_table(profiles: list[dict[str, Any]], limit: int = 8) -> Table | None:
    """The learned speed-up of the most observed elastic signatures: median seconds per unit count and the fit."""
    rows = [p for p in profiles if p.get("speedup")][:limit]
    if not rows:
        return None
    table = Table(title="learned speed-up (GET /v1/profiles)", title_justify="left")
    for column in ("task", "signature", "runs", "median by units (runs)", "serial", "per worker", "parallel start"):
        table.add_column(column, justify="right" if column in ("runs", "serial", "per worker", "parallel start")
                         else "left")
    for profile in rows:
        model = profile["speedup"]
        seen = "  ".join(f"{g['units']:g}: {_fmt(g['median_s'])} ({g['runs']})" for g in model["by_units"])
        table.add_row(profile["task"], profile["signature"], str(model["runs"]), seen, _fmt(model["serial_s"]),
                      _fmt(model["per_worker_s"]), _fmt(model["harness_s"]))
    return table


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def slo_table(tasks: list[dict[str, Any]]) -> Table | None:
    """Each planned task's SLO, predicted slowdown and measured attainment (windows within / windows)."""
    if not tasks:
        return None
    table = Table(title="task SLOs (GET /v1/tasks/slo)", title_justify="left")
    for column in ("task", "SLO", "predicted", "reserved GPUs", "windows", "within", "attainment", "last slowdown"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for task in tasks:
        predicted = task["predicted_slowdown"]
        over = predicted is None or predicted > task["slo"]
        attainment = task["attainment"]
        table.add_row(task["task"], _ratio(task["slo"]),
                      Text("unbounded" if predicted is None else _ratio(predicted), style="bold red" if over else ""),
                      str(task["reserved_gpus"] or "-"), str(task["windows"]), str(task["within"]),
                      "-" if attainment is None else f"{attainment:.0%}", _ratio(task["last_slowdown"]))
    return table


def placement_table(placement: dict[str, Any] | None) -> Table | None:
    """The GPU manager's placement of services over GPU types: each service's measured load and the GPUs' worth of
    each type it gets; the title says how it was found."""
    if placement is None:
        return None
    how = "not solved yet (no demand measured)" if placement["answered_by"] is None else (
        f"{placement['answered_by']}, t = {_fmt_number(placement['objective'])}, solved in "
        f"{placement['solve_s']:.3f} s" + (f" (fell back: {placement['fallback']})" if placement["fallback"] else ""))
    table = Table(title=f"GPU placement ({placement['method']}): {how}", title_justify="left")
    for column in ("service", "load (GPU-s/s)", "GPU types (GPUs' worth)", "confined"):
        table.add_column(column, justify="right" if column.startswith("load") else "left")
    for row in placement["services"]:
        table.add_row(row["service"], f"{row['load']:.3f}",
                      ", ".join(f"{kind} {gpus:.2f}" for kind, gpus in row["types"].items()) or "-",
                      "yes" if row["confined"] else "no (every node)")
    return table


def _fmt_number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def status_view(url: str, body: dict[str, Any], profiles: list[dict[str, Any]] | None = None) -> Group:
    """What ``tangram status`` shows: a table of resources, a line of queue and ACT figures and, when the broker
    has any, the tasks' SLOs, the placement of reward services over GPU types and the learned speed-up of the most
    observed elastic signatures."""
    table = Table(title=f"ARL-Tangram at {url}", title_justify="left")
    for column in ("resource", "pool", "manager", "utilization", "in use", "capacity", "queued"):
        table.add_column(column, justify="left" if column in ("resource", "pool", "manager", "utilization")
                         else "right")
    for row in body["resources"]:
        queued = Text(str(row["queued"]), style="bold yellow" if row["queued"] else "")
        table.add_row(row["resource"], row["pool"], row["manager"], _utilization(row["in_use"], row["capacity"]),
                      str(row["in_use"]), str(row["capacity"]), queued)
    stats = body["stats"]
    summary = Text.assemble(("queued ", "dim"), str(stats["queued"]), ("  running ", "dim"), str(stats["running"]),
                            ("  leases held ", "dim"), str(stats["leases"]),
                            (f"  ACT over the last {stats['recent']} actions: ", "dim"),
                            f"p50 {_fmt(stats['act_p50_s'])}  p90 {_fmt(stats['act_p90_s'])}  "
                            f"p99 {_fmt(stats['act_p99_s'])}")
    extra = (slo_table(body.get("slo", [])), placement_table(body.get("placement")), speedup_table(profiles or []))
    parts: list[RenderableType] = [table, summary, *(part for part in extra if part is not None)]
    return Group(*parts, Text(f"status page: {url}/ui", style="dim"))


def _status(args: argparse.Namespace) -> int:
    console = Console()
    url = args.url.rstrip("/")

    def view() -> Group:
        profiles = _fetch(url + "/v1/profiles?limit=100", args.token)["profiles"]
        return status_view(url, _fetch(url + "/v1/resources", args.token), profiles)

    try:
        if not args.watch:
            console.print(view())
            return 0
        # Ctrl-C sets a flag rather than raising wherever the loop happens to be (inside a library that might
        # swallow the KeyboardInterrupt); the loop ends at its next wait.
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda _signal, _frame: stop.set())
        with Live(view(), console=console, auto_refresh=False) as live:
            while not stop.wait(args.watch):
                live.update(view(), refresh=True)
        return 0
    except (urllib.error.URLError, OSError) as error:
        console.print(f"[red]cannot reach the broker at {url}: {error}[/red]")
        return 1
    except KeyboardInterrupt:  # before the handler above was installed
        return 0


async def _with_store(args: argparse.Namespace, work: Any) -> Any:
    """Run ``work(store)`` on the store of the config (``--config``, ``$TANGRAM_CONFIG``, ``$TANGRAM_STORE_URL``)."""
    from tangram.store.store import Store

    store = await Store.open(load_config(args.config).store.url)
    try:
        return await work(store)
    finally:
        await store.close()


def _token_create(args: argparse.Namespace) -> int:
    """A token for a task or the admin into the store: the token on stdout (only here, once), the rest on stderr."""
    from tangram.core.names import NAME
    from tangram.server.auth import mint

    if (args.task is None) == (not args.admin):
        print("tangram: give a TASK or --admin (a token belongs to exactly one of them)", file=sys.stderr)
        return 2
    if args.task is not None and not NAME.match(args.task):
        print(f"tangram: {args.task!r} is not a valid task name", file=sys.stderr)
        return 2
    row, token = mint(args.task, args.note or "")
    asyncio.run(_with_store(args, lambda store: store.add_token(row)))
    print(token)
    owner = "the admin" if args.task is None else f"task {args.task!r}"
    print(f"token {row.id} for {owner}; it is shown only now (the store keeps its SHA-256). A running broker "
          f"accepts it within [auth] refresh_s, or at once after POST /v1/admin/reload", file=sys.stderr)
    return 0


def _token_list(args: argparse.Namespace) -> int:
    from tangram.server.auth import token_json

    tokens = asyncio.run(_with_store(args, lambda store: store.load_tokens()))
    table = Table(title="tokens in the store", title_justify="left")
    for column in ("id", "owner", "note", "created", "revoked"):
        table.add_column(column)
    for token in map(token_json, tokens):
        when = [time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"
                for t in (token["created_at"], token["revoked_at"])]
        table.add_row(token["id"], "admin" if token["admin"] else token["task"], token["note"], *when)
    Console().print(table)
    return 0


def _token_revoke(args: argparse.Namespace) -> int:
    revoked = asyncio.run(_with_store(args, lambda store: store.revoke_token(args.id, time.time())))
    if revoked is None:
        print(f"tangram: no token {args.id!r} in the store", file=sys.stderr)
        return 1
    print(f"token {args.id} revoked; a running broker refuses it within [auth] refresh_s, or at once after "
          f"POST /v1/admin/reload", file=sys.stderr)
    return 0


def _token_hash(args: argparse.Namespace) -> int:
    """The SHA-256 that config files name a token by; the token comes from stdin (never from the command line,
    which other users and shell histories see), or ``--new`` makes one and prints it first."""
    from tangram.server.auth import new_token, token_sha256

    if args.new:
        token = new_token()
        print(token)
    else:
        token = sys.stdin.readline().strip()
        if not token:
            print("tangram: give the token on stdin (or --new to make one)", file=sys.stderr)
            return 2
    print(token_sha256(token))
    return 0


def _image_build(args: argparse.Namespace) -> int:
    """Build (once) and import the default sandbox image into every engine, with a progress bar for debootstrap."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    from sandboxes.image import (
        DEFAULT_ENGINE,
        DEFAULT_IMAGE,
        DEFAULT_MIRROR,
        BuildProgress,
        ImageBuildError,
        ensure_image,
    )

    console = Console(stderr=True, soft_wrap=True, highlight=False)
    engines = args.engine or [os.environ.get("DOCKER_HOST") or DEFAULT_ENGINE]
    columns = (TextColumn("[bold]{task.description}", table_column=Column(width=22, no_wrap=True)),
               BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[line]}", style="dim",  # what is left of the terminal's width
                          table_column=Column(no_wrap=True, overflow="ellipsis", width=max(console.width - 67, 1))))
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as progress:
        tasks: dict[str, Any] = {}  # one bar per phase, each filled when the next one starts

        def on_build(step: BuildProgress) -> None:
            if step.phase not in tasks:
                for previous in tasks.values():  # a phase that ended is complete, whatever its estimate said
                    total = progress.tasks[previous].total or 1
                    progress.update(previous, completed=total, total=total)
            if step.phase in ("cached", "done"):
                progress.console.print(f"root filesystem: {step.line}")
                return
            if step.phase not in tasks:
                tasks[step.phase] = progress.add_task(f"debootstrap: {step.phase}", total=step.total, line="")
                if not console.is_terminal:  # a CI log gets one line per phase instead of a bar
                    console.print(f"debootstrap: {step.phase} ({step.line})")
            progress.update(tasks[step.phase], completed=step.done, total=step.total, line=step.line)

        def on_import(message: str) -> None:
            progress.console.print(message)

        try:
            kwargs = {"cache_dir": args.cache_dir} if args.cache_dir else {}
            report = ensure_image(engines, args.name or DEFAULT_IMAGE, mirror=args.mirror or DEFAULT_MIRROR,
                                  rebuild=args.rebuild, force=args.force, build_progress=on_build,
                                  import_progress=on_import, **kwargs)
        except ImageBuildError as error:
            progress.stop()
            print(f"tangram: {error}", file=sys.stderr)
            return 1
    if report.tarball is not None:
        how = f"built in {report.build_seconds:.0f} s" if report.built else "reused"
        console.print(f"root filesystem {report.tarball} ({how})")
    imported = sum(not result.skipped for result in report.imports)
    console.print(f"[green]{report.name} present on {len(report.imports)} engine(s), imported into {imported}[/green]")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tangram", description="ARL-Tangram action-level resource broker")
    parser.add_argument("--version", action="version", version=f"tangram {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the broker")
    serve.add_argument("--config", help="TOML config file (defaults serve on a laptop)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--ray", metavar="ADDRESS", help="the Ray cluster of the nodes behind agents and of joining "
                                                       "nodes ([ray] address); this host must be one of its nodes")
    serve.add_argument("--insecure", action="store_true", help="listen on a non-loopback --host even though the "
                       "config says [auth] required = false (refused otherwise; without that line the first start "
                       "there makes an admin token and prints it once)")
    serve.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get(LOG_FORMAT_ENV, "text"),
                       help="text lines, or one JSON object per line with the action's ids (default "
                            f"${LOG_FORMAT_ENV} or text)")
    serve.set_defaults(func=_serve)
    doctor = commands.add_parser("doctor", help="check the config, store, Docker engines and images, Ray and GPUs "
                                 "a broker would use; one PASS/FAIL/SKIP line each, exit 1 on any FAIL")
    doctor.add_argument("--config", help=CONFIG_OR_DEFAULTS)
    doctor.add_argument("--json", action="store_true", help="the results as a JSON list")
    doctor.set_defaults(func=_doctor)
    config = commands.add_parser("config", help="the config file")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    check = config_commands.add_parser("check", help="parse the file as serve does: ok and a summary, or the bad "
                                       "key and why (exit 2)")
    check.add_argument("--config", help=CONFIG_OR_DEFAULTS)
    check.set_defaults(func=_config_check)
    status = commands.add_parser("status", help="show resources, queues and recent ACT of a running broker")
    status.add_argument("--url", default="http://127.0.0.1:8300")
    status.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    status.add_argument("--token", default=os.environ.get("TANGRAM_TOKEN"),
                        help="API token, when the broker's status is not public (default $TANGRAM_TOKEN)")
    status.set_defaults(func=_status)
    token = commands.add_parser("token", help="API tokens in the store (hashed), and hashes for the config file")
    token_commands = token.add_subparsers(dest="token_command", required=True)
    create = token_commands.add_parser("create", help="make a token for TASK (or --admin) in the store; prints it "
                                       "once on stdout")
    create.add_argument("task", nargs="?", help="the RL task the token belongs to")
    create.add_argument("--admin", action="store_true", help="an admin token instead")
    create.add_argument("--note", help="who or what it is for (shown by list)")
    listing = token_commands.add_parser("list", help="the store's tokens (never their hashes)")
    revoke = token_commands.add_parser("revoke", help="revoke a token in the store by its id")
    revoke.add_argument("id")
    for sub, func in ((create, _token_create), (listing, _token_list), (revoke, _token_revoke)):
        sub.add_argument("--config", help="TOML config file naming the store (default $TANGRAM_CONFIG, "
                         "$TANGRAM_STORE_URL or ./tangram.db)")
        sub.set_defaults(func=func)
    hashing = token_commands.add_parser("hash", help="print the SHA-256 of the token on stdin, for token_sha256 "
                                        "in the config")
    hashing.add_argument("--new", action="store_true", help="make a token, print it, then its hash")
    hashing.set_defaults(func=_token_hash)
    image = commands.add_parser("image", help="build the default sandbox image offline and import it into engines")
    image_commands = image.add_subparsers(dest="image_command", required=True)
    build = image_commands.add_parser("build", help="debootstrap the sandbox root filesystem (cached) and "
                                      "docker-import it into every engine that lacks it")
    build.add_argument("--name", help="image name (default tangram/sandbox-python:bookworm)")
    build.add_argument("--engine", action="append", metavar="URL",
                       help="Docker engine URL, repeatable (default $DOCKER_HOST or unix:///var/run/docker.sock)")
    build.add_argument("--cache-dir", help="where the root filesystem tarball is kept (default "
                       "/var/cache/tangram/images)")
    build.add_argument("--mirror", help="Debian mirror (default http://deb.debian.org/debian)")
    build.add_argument("--rebuild", action="store_true", help="run debootstrap again even if a tarball is cached "
                       "(and re-import everywhere)")
    build.add_argument("--force", action="store_true", help="import even into engines that already have the image")
    build.set_defaults(func=_image_build)
    add_simulation_commands(commands, _deployment)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"tangram: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
