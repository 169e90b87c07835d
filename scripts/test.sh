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
# Without arguments the suite runs as two pytest processes at once: the tests that need Docker, Ray, a browser or
# PostgreSQL (tests/needs.py marks them from their code) one at a time, since they share the engines' cores, one
# database and the machine's Ray; the rest beside them, its log printed when both are done. (pytest-xdist's
# loadgroup would do this in one process, but it cannot group under pytest >= 9.2.) Arguments run one process with
# them. A crash, even at interpreter exit, prints its Python stack (PYTHONFAULTHANDLER). The suite's budget is 30 min;
# each lane lists its slowest tests.
export PYTHONFAULTHANDLER=1
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q --durations=30 "$@"
fi
NEEDS="docker or ray or browser or postgres"
rest_log=$(mktemp)
python -m pytest -q --durations=10 -m "not ($NEEDS)" > "$rest_log" 2>&1 &
rest=$!
shared_status=0
python -m pytest -q --durations=30 -m "$NEEDS" || shared_status=$?
rest_status=0
wait "$rest" || rest_status=$?
echo "--- the tests that need none of them ($NEEDS) ---"
cat "$rest_log"
rm -f "$rest_log"
echo "test.sh: exit status $shared_status with $NEEDS, $rest_status without"
[ "$shared_status" -eq 0 ] && [ "$rest_status" -eq 0 ]
