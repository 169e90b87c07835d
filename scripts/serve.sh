#!/usr/bin/env bash
# Install ARL-Tangram into .venv (first run only) and start the broker on embedded defaults:
# local node, SQLite file ./tangram.db, Basic manager with a `lease.local` resource, on http://127.0.0.1:8300.
# The CPU manager runs `exec` in Docker sandboxes when the local engine answers and has the sandbox image. Where it
# does not (a fresh machine), this script says so on stderr and chooses, explicitly, unsandboxed local processes
# through a config file of its own (.venv/tangram-unsandboxed.toml): the broker itself never falls back to them.
# Extra arguments go to `tangram serve` (e.g. --config tangram.toml --port 9000); with --config or $TANGRAM_CONFIG
# the file decides and this script chooses nothing.
set -euo pipefail
source "$(dirname "$0")/venv.sh"

config_given() {
    [ -n "${TANGRAM_CONFIG:-}" ] && return 0
    for arg in "$@"; do
        case "$arg" in --config | --config=*) return 0 ;; esac
    done
    return 1
}

if config_given "$@"; then
    exec tangram serve "$@"
fi
# why the default Docker node cannot start here, if it cannot (empty: it can)
missing=$(python - <<'EOF'
import docker
from managers.cpu.config import LOCAL_ENGINE
from sandboxes.image import DEFAULT_IMAGE
try:
    client = docker.DockerClient(base_url=LOCAL_ENGINE, timeout=10)
    client.images.get(DEFAULT_IMAGE)
except docker.errors.ImageNotFound:
    print(f"the Docker engine has no image {DEFAULT_IMAGE} (make it: .venv/bin/tangram image build)")
except Exception as error:
    print(f"no Docker engine answers at {LOCAL_ENGINE} ({type(error).__name__})")
EOF
)
if [ -z "$missing" ]; then
    exec tangram serve "$@"
fi
config="$root/.venv/tangram-unsandboxed.toml"
cat > "$config" <<'EOF'
# Written by scripts/serve.sh where no Docker engine with the sandbox image was found: exec actions run as local
# processes, unsandboxed, as the broker's user with its environment. Install Docker and build the image
# (.venv/bin/tangram image build) for sandboxes; serve.sh then starts without this file.
[cpu.nodes.local]
backend = "local"
unsandboxed = true
EOF
echo "serve.sh: $missing." >&2
echo "serve.sh: WARNING: exec actions run as UNSANDBOXED local processes (as $(id -un), with this shell's" \
     "environment), chosen in $config. Install Docker and build the image for sandboxes." >&2
exec tangram serve --config "$config" "$@"
