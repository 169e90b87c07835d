#!/usr/bin/env bash
# Install what the tests need (project + dev extras in .venv, PostgreSQL from Debian's packages) and run them.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash scripts/start-postgres.sh)"
TANGRAM_EXTRAS=dev source scripts/venv.sh
python -m pytest -q "$@"
