# Sourced by serve.sh and test.sh: make (once) and activate the project's virtual environment in .venv,
# with the project installed in editable mode plus the extras named in TANGRAM_EXTRAS.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    echo "ARL-Tangram needs Python >= 3.11 as python3" >&2
    exit 1
fi
if [ ! -x "$root/.venv/bin/python" ]; then
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
        echo "installing python3-venv from Debian's packages" >&2
        apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    fi
    python3 -m venv "$root/.venv"
fi
# shellcheck disable=SC1091
source "$root/.venv/bin/activate"
stamp="$root/.venv/.installed-${TANGRAM_EXTRAS:-base}"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    python -m pip install -q --upgrade pip
    python -m pip install -q -e "$root${TANGRAM_EXTRAS:+[$TANGRAM_EXTRAS]}"
    touch "$stamp"
fi
