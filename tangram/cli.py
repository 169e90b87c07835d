"""``tangram`` command line: ``serve`` runs the broker, ``status`` shows a running one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console
from rich.table import Table

from tangram.config import load_config
from tangram.errors import ConfigError


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


def _status(args: argparse.Namespace) -> int:
    console = Console()
    try:
        body = _fetch(args.url.rstrip("/") + "/v1/resources")
    except (urllib.error.URLError, OSError) as error:
        console.print(f"[red]cannot reach the broker at {args.url}: {error}[/red]")
        return 1
    table = Table(title=f"ARL-Tangram at {args.url}")
    for column in ("resource", "pool", "manager", "capacity", "in use", "queued"):
        table.add_column(column, justify="left" if column in ("resource", "pool", "manager") else "right")
    for row in body["resources"]:
        table.add_row(row["resource"], row["pool"], row["manager"], str(row["capacity"]), str(row["in_use"]),
                      str(row["queued"]))
    console.print(table)
    stats = body["stats"]
    console.print(f"queued {stats['queued']}  running {stats['running']}  leases held {stats['leases']}  "
                  f"recent ACT over {stats['recent']} actions: p50 {_fmt(stats['act_p50_s'])}  "
                  f"p90 {_fmt(stats['act_p90_s'])}  p99 {_fmt(stats['act_p99_s'])}")
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
    status.set_defaults(func=_status)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"tangram: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
