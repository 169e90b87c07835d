#!/usr/bin/env bash
# Install ARL-Tangram into .venv (first run only) and start the broker on embedded defaults:
# local node, SQLite file ./tangram.db, Basic manager with a `lease.local` resource, on http://127.0.0.1:8300.
# Extra arguments go to `tangram serve` (e.g. --config tangram.toml --port 9000).
set -euo pipefail
source "$(dirname "$0")/venv.sh"
exec tangram serve "$@"
