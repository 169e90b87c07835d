"""The image's HEALTHCHECK: ``GET /healthz`` on the address the broker's config file gives.

It reads ``server.host`` and ``server.port`` from ``$TANGRAM_CONFIG`` with tomllib alone: importing the broker's
config module would load aiohttp, docker and psutil on every check. A port given to ``tangram serve --port``
instead of the file is not seen here; set ``server.port`` in the file.
"""

from __future__ import annotations

import os
import sys
import tomllib
import urllib.request
from collections.abc import Mapping

#: tangram.config.ServerConfig's defaults (tests/test_deploy.py checks that they agree)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8300
#: addresses that mean "every interface": the check goes to loopback instead
WILDCARDS = {"", "0.0.0.0", "::"}


def healthz_url(environ: Mapping[str, str]) -> str:
    """The URL of ``/healthz`` for the config file named by ``TANGRAM_CONFIG`` (defaults without one)."""
    server: dict[str, object] = {}
    path = environ.get("TANGRAM_CONFIG")
    if path:
        with open(path, "rb") as handle:
            server = tomllib.load(handle).get("server", {})
    host = str(server.get("host", DEFAULT_HOST))
    port = int(str(server.get("port", DEFAULT_PORT)))
    if host in WILDCARDS:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def main() -> int:
    url = healthz_url(os.environ)
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            response.read()
    except (OSError, ValueError) as error:
        print(f"{url}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
