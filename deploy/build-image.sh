#!/usr/bin/env bash
# Build the broker's image, tangram/broker:<version>, offline: no image registry, no network inside the build.
#   1. the base, tangram/broker-base:bookworm: a Debian bookworm minbase root filesystem with python3 and
#      ca-certificates, made by debootstrap from Debian's mirror (sandboxes/image.py), cached as a tarball under
#      /var/cache/tangram/images and `docker import`ed;
#   2. a wheelhouse made on this host from PyPI (or pip's configured index): the arl-tangram wheel and the wheels of
#      its base dependencies for CPython 3.11 on manylinux (no extras, so no torch);
#   3. `docker build --network none` of deploy/Dockerfile on the base with those wheels.
# Idempotent and cached: the base is imported once; the image is rebuilt only when the sources it is made from
# (the packages, pyproject.toml, deploy/Dockerfile, deploy/image/) changed, which the image records in a label; an
# unchanged dependency set reuses Docker's cached layer. Needs root (debootstrap) and a Docker engine ($DOCKER_HOST,
# else /var/run/docker.sock). Progress goes to stderr; the image's name is the only line on stdout.
# Usage: bash deploy/build-image.sh [--rebuild] [--ray]
#   --rebuild: build even when the image's sources are unchanged
#   --ray: tangram/broker-ray:<version> instead, with the ray extra (the broker, the Ray head and the node agents of
#          deploy/docker-compose.ray.yaml and deploy/k8s-ray run it)
set -euo pipefail
exec 3>&1 1>&2
root=$(cd "$(dirname "$0")/.." && pwd)
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

BASE=tangram/broker-base:bookworm
BASE_PACKAGES=python3,ca-certificates
BASE_PYTHON=3.11            # bookworm's python3: the wheels are chosen for it
OLDEST_GLIBC_MINOR=17       # manylinux_2_17 (manylinux2014) ...
NEWEST_GLIBC_MINOR=36       # ... up to bookworm's glibc 2.36
DIGEST_LABEL=org.arl-tangram.source-digest
engine=${DOCKER_HOST:-unix:///var/run/docker.sock}

rebuild=0
extras=""
for arg in "$@"; do
    case $arg in
        --rebuild) rebuild=1 ;;
        --ray) extras="[ray]" ;;
        *) echo "build-image.sh: unknown argument $arg (usage: build-image.sh [--rebuild] [--ray])" >&2; exit 2 ;;
    esac
done
if [ "$(id -u)" != 0 ]; then
    echo "build-image.sh: must run as root (debootstrap builds the base image's root filesystem)" >&2
    exit 1
fi
command -v docker >/dev/null || { echo "build-image.sh: no docker command; install docker.io" >&2; exit 1; }
docker -H "$engine" version --format '{{.Server.Version}}' >/dev/null ||
    { echo "build-image.sh: the Docker engine at $engine does not answer" >&2; exit 1; }

if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    python=$VIRTUAL_ENV/bin/python
elif [ -x "$root/.venv/bin/python" ]; then
    python=$root/.venv/bin/python
else
    # shellcheck disable=SC1091
    source "$root/scripts/venv.sh"   # makes .venv with the project (sandboxes/image.py needs the docker SDK)
    python=$root/.venv/bin/python
fi

work=$(mktemp -d /var/tmp/tangram-broker-build.XXXXXX)
trap 'rm -rf "$work"' EXIT

# The version, and a digest of every file the image is made from; the package sources are copied to $work/src
# so that building the wheel writes nothing into the checkout.
meta=$("$python" - "$root" "$work/src" <<'EOF'
import hashlib, shutil, sys, tomllib
from pathlib import Path

root, copy_to = Path(sys.argv[1]), Path(sys.argv[2])
with open(root / "pyproject.toml", "rb") as handle:
    project = tomllib.load(handle)
find = project["tool"]["setuptools"]["packages"]["find"]
tops = sorted({pattern.rstrip("*").split(".")[0] for pattern in find["include"]})
# each package's folder, in whichever of find's "where" folders holds it (the client's package is in clients/)
folders = [root / where / top for top in tops for where in find.get("where", ["."]) if (root / where / top).is_dir()]
files = [root / "pyproject.toml", root / project["project"]["readme"]]
files += sorted(f for folder in folders for f in folder.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
image_files = [root / "deploy" / name for name in ("Dockerfile", "build-image.sh")]
image_files += sorted((root / "deploy" / "image").iterdir())
digest = hashlib.sha256()
for path in files + image_files:
    relative = path.relative_to(root).as_posix()
    digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
for path in files:
    target = copy_to / path.relative_to(root)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, target)
print(project["project"]["version"], digest.hexdigest())
EOF
)
read -r version digest <<<"$meta"
image=tangram/broker${extras:+-ray}:$version

built_from=$(docker -H "$engine" image inspect --format "{{ index .Config.Labels \"$DIGEST_LABEL\" }}" "$image" \
    2>/dev/null || true)
if [ "$rebuild" = 0 ] && [ "$built_from" = "$digest" ]; then
    echo "$image is up to date (sources unchanged)"
    echo "$image" >&3
    exit 0
fi

# 1. The base image: debootstrap only when neither the engine nor the tarball cache has it.
"$python" - "$engine" "$BASE" "$BASE_PACKAGES" <<'EOF'
import sys

from sandboxes.image import ImageBuildError, build_rootfs_tarball, image_exists, import_image

engine, name, packages = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
phases: list[str] = []

def progress(step) -> None:
    if not phases or phases[-1] != step.phase:  # one line per phase, not one per package
        phases.append(step.phase)
        print(f"base root filesystem: {step.phase}: {step.line}", file=sys.stderr)

try:
    if image_exists(engine, name):
        print(f"{name} is present", file=sys.stderr)
    else:
        tarball = build_rootfs_tarball(name, packages=packages, progress=progress)
        import_image(engine, tarball, name, lambda message: print(message, file=sys.stderr))
except ImageBuildError as error:
    sys.exit(f"build-image.sh: {error}")
EOF

# 2. The wheelhouse: the project's wheel, then what it depends on, as binary wheels for the base's Python.
context=$work/context
mkdir -p "$context/pip" "$context/deps" "$context/project"
platforms=()
for minor in $(seq "$NEWEST_GLIBC_MINOR" -1 "$OLDEST_GLIBC_MINOR"); do
    platforms+=(--platform "manylinux_2_${minor}_$(uname -m)")
done
target=(--only-binary=:all: --python-version "$BASE_PYTHON" --implementation cp --abi "cp${BASE_PYTHON/./}"
        "${platforms[@]}")
echo "building the arl-tangram $version wheel"
# (setuptools' deprecation warnings would bury the log: they are shown only if the build fails)
if ! log=$("$python" -m pip wheel --quiet --no-deps --wheel-dir "$context/project" "$work/src" 2>&1); then
    echo "$log"
    exit 1
fi
echo "downloading its dependencies' wheels for CPython $BASE_PYTHON"
wheel=$(echo "$context"/project/*.whl)
"$python" -m pip download --quiet --dest "$context/deps" "${target[@]}" "$wheel$extras"
rm -f "$context"/deps/arl_tangram-*.whl
"$python" -m pip download --quiet --no-deps --dest "$context/pip" "${target[@]}" pip
cp "$root/deploy/Dockerfile" "$context/Dockerfile"
cp -r "$root/deploy/image" "$context/image"

# 3. The image, with no network: everything it installs is in the context.
echo "building $image"
docker -H "$engine" build --network none --force-rm --build-arg "BASE=$BASE" --label "$DIGEST_LABEL=$digest" \
    --label "org.opencontainers.image.version=$version" --label "org.opencontainers.image.title=arl-tangram broker" \
    --tag "$image" "$context"
echo "$image" >&3
