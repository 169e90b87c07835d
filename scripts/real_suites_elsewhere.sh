#!/bin/bash
# Issue 15's real-suites bench on a machine with many cores and no Docker (a lent GPU machine): the broker on that
# machine's Python with the project's pure-Python dependencies carried as wheels, the suites in a venv of their
# own that holds only pytest and pytest-xdist, sandboxes as local processes.
#
#   bash scripts/real_suites_elsewhere.sh prepare   # here, with the registry: wheels into .whl and .suitewhl,
#                                                   # the pinned sdists into .suites (all git-ignored; ~21 MB)
#   bash scripts/real_suites_elsewhere.sh run       # there, from the repository root, .whl .suitewhl .suites carried
#   bash scripts/real_suites_elsewhere.sh runner    # there: the elastic runner against xdist and plain pytest,
#                                                   # directly on pinned cores (loadtest/bench_runner.py; .suitewhl
#                                                   # and .suites carried)
#
# run's settings: ROUNDS (3), TRAJ (10), CORES (0-15), BENCH_S (time limit, 470), PY_TAG (312: the Python there);
# the log goes to $OUT (else /tmp) as bench_real_suites.log. runner's: ROUNDS, CORES, BENCH_S (no run starts after
# it), GROW (1:2 4:16), SUITES (names, run in that order; all by default); its log and JSON go to $OUT as
# bench_runner.log and bench_runner.json.
set -u
cd "$(dirname "$0")/.."

suite_venv() {  # the suites' interpreter: a venv holding only pytest and pytest-xdist (.suitewhl)
    python3 -m venv --without-pip /tmp/suitepy || return 1
    local site
    site=$(/tmp/suitepy/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for wheel in .suitewhl/*.whl; do python3 -m zipfile -e "$wheel" "$site" || return 1; done
}
case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.suitewhl/\n/.suites/\n' >> .git/info/exclude
    platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    for package in pydantic pydantic_core annotated-types typing-inspection typing_extensions orjson SQLAlchemy \
                   greenlet aiosqlite asyncpg docker; do
        version=$(python3 -m pip show "$package" 2>/dev/null | awk '/^Version/ {print $2}')
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_TAG:-312}" \
            --implementation cp "${platforms[@]}" -d .whl "$package==$version" || exit 1
    done
    python3 -m pip download -q --no-deps --only-binary=:all: -d .suitewhl pytest==8.3.5 pytest-xdist==3.6.1 \
        execnet==2.1.1 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2 || exit 1
    python3 -c "from pathlib import Path; from loadtest.suites import SUITES, fetch
[fetch(suite, Path('.suites')) for suite in SUITES]" || exit 1
    du -sh .whl .suitewhl .suites ;;
run)
    PY=$(command -v python3)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    suite_venv || exit 1
    export PATH=/tmp/suitepy/bin:$PATH
    echo "cores $(nproc); suites' $(python3 --version), $(python3 -m pytest --version 2>&1)"
    python3 -c "import numpy" 2>/dev/null && echo "numpy is visible to the suites" || echo "numpy is not visible to the suites"
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout "${BENCH_S:-470}" "$PY" -m loadtest.bench_real_suites \
        --engine local --no-profiles --no-profiling --rounds "${ROUNDS:-3}" --trajectories "${TRAJ:-10}" --stagger 1 \
        --cores "${CORES:-0-15}" --memory-mb 4096 --cache-dir .suites 2>&1 | tee "${OUT:-/tmp}/bench_real_suites.log" ;;
runner)
    suite_venv || exit 1
    grows=() suites=()
    for grow in ${GROW:-1:2 4:16}; do grows+=(--grow "$grow"); done
    for suite in ${SUITES:-}; do suites+=(--suite "$suite"); done
    PYTHONUNBUFFERED=1 python3 -m loadtest.bench_runner --python /tmp/suitepy/bin/python3 --cores "${CORES:-0-15}" \
        --rounds "${ROUNDS:-2}" --no-one-core "${grows[@]}" "${suites[@]}" --budget-s "${BENCH_S:-300}" \
        --cache-dir .suites \
        --json "${OUT:-/tmp}/bench_runner.json" 2>&1 | tee "${OUT:-/tmp}/bench_runner.log" ;;
*)
    echo "usage: bash scripts/real_suites_elsewhere.sh prepare|run|runner" >&2
    exit 2 ;;
esac
