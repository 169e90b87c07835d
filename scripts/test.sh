#!/usr/bin/env bash
# Install what the tests need and run them, on a fresh Debian machine as root: PostgreSQL from Debian's packages,
# the project with its dev extras in .venv, two Docker engines (docker.io) standing for two nodes, the default sandbox
# image built offline (debootstrap) and imported into both, headless Chromium for the status page tests, and
# Prometheus's binaries for the deploy tests. Then the static checks (ruff, and mypy over the packages, benchmarks,
# scripts and tests: [tool.mypy] in pyproject.toml) and the suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Run a setup script that prints export lines and take them into this shell. ``eval "$(script)"`` alone would hide
# the script's failure (eval of an empty string succeeds) and run the suite without what it needs; the scripts are
# idempotent, so a failure (a package mirror's hiccup) is retried once, then ends the run.
setup() {
    local exports
    if ! exports=$(bash "$@"); then
        echo "test.sh: $* failed; trying it once more" >&2
        exports=$(bash "$@") || { echo "test.sh: $* failed twice; see its messages above" >&2; exit 1; }
    fi
    eval "$exports"
}

setup scripts/start-postgres.sh
TANGRAM_EXTRAS=dev source scripts/venv.sh
setup scripts/start-docker.sh
setup scripts/install-chromium.sh
setup scripts/install-prometheus.sh
export HF_HUB_OFFLINE=1  # the reward model comes from a Python package; nothing is downloaded
python -m ruff check .
python -m mypy
python -m pytest -q --durations=30 "$@"  # the slowest tests in CI's log: the suite has a 30-min budget
