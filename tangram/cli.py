"""``tangram`` command line: ``serve`` runs the broker, ``status`` shows a running one, ``image build`` makes the
sandbox image, ``simulate`` and ``trace`` run the simulator."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tangram.config import load_config
from tangram.errors import ConfigError
from tangram.sim.commands import add_commands as add_simulation_commands


def _serve(args: argparse.Namespace) -> int:
    from tangram.service import run

    config = load_config(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **overrides))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(config)
    except KeyboardInterrupt:
        pass
    return 0


def _fetch(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _utilization(in_use: int, capacity: int) -> Text:
    """A ten-cell bar and percentage, green below 70 %, yellow below 90 %, red above."""
    share = in_use / capacity if capacity else 0.0
    cells = round(share * 10)
    style = "green" if share < 0.7 else "yellow" if share < 0.9 else "red"
    return Text.assemble(("█" * cells, style), ("░" * (10 - cells), "dim"), f" {share:4.0%}")


def status_view(url: str, body: dict[str, Any]) -> Group:
    """What ``tangram status`` shows: a table of resources and a line of queue and ACT figures."""
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
    return Group(table, summary, Text(f"status page: {url}/ui", style="dim"))


def _status(args: argparse.Namespace) -> int:
    console = Console()
    url = args.url.rstrip("/")

    def view() -> Group:
        return status_view(url, _fetch(url + "/v1/resources"))

    try:
        if not args.watch:
            console.print(view())
            return 0
        with Live(view(), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.watch)
                live.update(view(), refresh=True)
    except (urllib.error.URLError, OSError) as error:
        console.print(f"[red]cannot reach the broker at {url}: {error}[/red]")
        return 1
    except KeyboardInterrupt:
        return 0


def _image_build(args: argparse.Namespace) -> int:
    """Build (once) and import the default sandbox image into every engine, with a progress bar for debootstrap."""
    import os

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
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the broker")
    serve.add_argument("--config", help="TOML config file (defaults serve on a laptop)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=_serve)
    status = commands.add_parser("status", help="show resources, queues and recent ACT of a running broker")
    status.add_argument("--url", default="http://127.0.0.1:8300")
    status.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    status.set_defaults(func=_status)
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
    add_simulation_commands(commands)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"tangram: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
