"""The default Python sandbox image, built offline: debootstrap a Debian root filesystem, tar it, ``docker import`` it.

There is no image registry to pull from, only Debian's package mirror, so the image is made from packages: a
``minbase`` Debian with Python, pytest, pytest-xdist and git. The root filesystem tarball is cached on disk, so a
second engine (another node) or a second run imports it without running debootstrap again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
from docker.utils import parse_repository_tag

DEFAULT_IMAGE = "tangram/sandbox-python:bookworm"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_CACHE_DIR = Path("/var/cache/tangram/images")
DEFAULT_ENGINE = "unix:///var/run/docker.sock"
#: what a sandbox needs on top of minbase; debootstrap resolves their dependencies
PACKAGES: tuple[str, ...] = ("python3", "python3-pytest", "python3-pytest-xdist", "git")
#: the image's config, as ``docker import --change`` lines
IMAGE_CHANGES: tuple[str, ...] = (
    # An imported image has no PATH of its own; Docker fills one in for `run` but not every client or runtime does.
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "WORKDIR /workspace",
    "ENV LANG=C.UTF-8",
    "ENV PYTHONDONTWRITEBYTECODE=1",
    'CMD ["python3"]',
)
# Progress calibration, measured on bookworm minbase + PACKAGES: 142 packages retrieved, 88 of them (minbase's
# "required" set) extracted, then 276 Unpacking/Configuring lines: two per package, less the few core packages
# debootstrap installs without a line.
#: packages retrieved; sizes the bar until retrieval has finished and the count is exact
PACKAGE_ESTIMATE = 142
#: packages extracted in the first stage (the required set, whatever is included)
EXTRACT_ESTIMATE = 88
#: Unpacking plus Configuring lines per retrieved package
INSTALL_LINES_PER_PACKAGE = 276 / 142
#: phases in the order they happen ("shrink" and "tar" are ours); "cached" alone means nothing had to be built
PHASES: tuple[str, ...] = ("cached", "resolve", "retrieve", "extract", "install", "shrink", "tar", "done")

_PACKAGE_LINE = re.compile(r"^I: (Retrieving|Validating) ([a-z0-9][a-z0-9+.-]*) (\S+)$")
_STEP_LINE = re.compile(r"^I: (Unpacking|Configuring) ([a-z0-9][a-z0-9+.:-]*)\.\.\.$")


class ImageBuildError(Exception):
    """Building or importing the sandbox image failed; the message says what to do about it."""


@dataclass(frozen=True)
class BuildProgress:
    """One step of the root filesystem build, for a progress bar.

    ``done`` counts debootstrap's lines for ``phase`` so far (one per package retrieved, extracted, unpacked or
    configured); ``total`` is what the phase is expected to reach (exact for retrieval once it has finished,
    estimated otherwise, never below ``done``), or None where there is nothing to count.
    """

    phase: str
    done: int
    total: int | None
    line: str


@dataclass(frozen=True)
class ImportResult:
    """What ``import_image`` did on one engine."""

    engine: str
    name: str
    image_id: str
    skipped: bool
    seconds: float = 0.0


@dataclass
class EnsureReport:
    """What ``ensure_image`` did: whether it built the tarball, and one result per engine."""

    name: str
    tarball: Path | None
    built: bool
    build_seconds: float = 0.0
    imports: list[ImportResult] = field(default_factory=list)


BuildCallback = Callable[[BuildProgress], None]
MessageCallback = Callable[[str], None]


def tarball_path(name: str = DEFAULT_IMAGE, cache_dir: Path | str = DEFAULT_CACHE_DIR) -> Path:
    """The cache file for ``name``: one tarball per image name, so another image never reuses it."""
    return Path(cache_dir) / (re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".tar")


def build_rootfs_tarball(
    name: str = DEFAULT_IMAGE,
    *,
    cache_dir: Path | str = DEFAULT_CACHE_DIR,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    packages: Sequence[str] = PACKAGES,
    rebuild: bool = False,
    progress: BuildCallback | None = None,
) -> Path:
    """Return the cached root filesystem tarball for ``name``, running debootstrap first if there is none.

    The root filesystem is built in a temporary directory next to the cache (same filesystem, so the tarball can
    be renamed into place atomically and a killed build never leaves a half-written cache file). A lock file
    serialises concurrent builds: the second one waits and then reuses the first one's tarball.
    """
    report = progress or (lambda _: None)
    target = tarball_path(name, cache_dir)
    if target.is_file() and not rebuild:
        report(BuildProgress("cached", 1, 1, f"reusing {target}"))
        return target
    debootstrap = _find_debootstrap()
    if os.geteuid() != 0:
        raise ImageBuildError("building the sandbox image needs root (debootstrap creates device nodes and "
                              "chroots): run it as root")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ImageBuildError(f"cannot create the image cache directory {target.parent}: {error}") from error
    with _locked(target.with_name(target.name + ".lock")):
        if target.is_file() and not rebuild:  # another build finished while we waited for the lock
            report(BuildProgress("cached", 1, 1, f"reusing {target}"))
            return target
        for stale in target.parent.glob(f".{target.stem}.build-*"):  # left by a killed build; we hold the lock
            _remove_tree(stale)
        work = Path(tempfile.mkdtemp(prefix=f".{target.stem}.build-", dir=target.parent))
        try:
            rootfs = work / "rootfs"
            _run_debootstrap(debootstrap, suite, rootfs, mirror, packages, report)
            report(BuildProgress("shrink", 0, None, "removing caches, documentation and translations"))
            _shrink(rootfs)
            (rootfs / "workspace").mkdir(mode=0o755, exist_ok=True)
            # The tar records the top directory's mode as the image's "/": keep it world-readable.
            rootfs.chmod(0o755)
            report(BuildProgress("tar", 0, None, f"writing {target}"))
            partial = target.with_name(target.name + ".partial")
            _write_tar(rootfs, partial)
            os.replace(partial, target)
        finally:
            _remove_tree(work)
    report(BuildProgress("done", 1, 1, f"wrote {target} ({target.stat().st_size / 2**20:.0f} MiB)"))
    return target


def import_image(
    engine_url: str,
    tarball: Path | str,
    name: str = DEFAULT_IMAGE,
    progress: MessageCallback | None = None,
    *,
    force: bool = False,
) -> ImportResult:
    """``docker import`` the tarball into one engine as ``name``, unless that engine already has it.

    Skipping is what makes repeated runs cheap; ``force`` re-imports (the new image takes the name over).
    """
    report = progress or (lambda _: None)
    started = time.monotonic()
    with _client(engine_url) as client:
        existing = _image_id(client, name)
        if existing is not None and not force:
            report(f"{engine_url}: {name} already present ({_short(existing)}), skipped")
            return ImportResult(engine_url, name, existing, skipped=True)
        path = Path(tarball)
        # The SDK treats a path it cannot open as a URL for the engine to fetch: check it here for a clear error.
        if not path.is_file():
            raise ImageBuildError(f"root filesystem tarball {path} does not exist or is not a file "
                                  "(build it with `tangram image build`)")
        repository, tag = parse_repository_tag(name)
        report(f"{engine_url}: importing {path} ({path.stat().st_size / 2**20:.0f} MiB) as {name}")
        try:
            answer = client.api.import_image(src=str(path), repository=repository, tag=tag or "latest",
                                             changes=list(IMAGE_CHANGES))
        except docker.errors.DockerException as error:
            raise ImageBuildError(f"{engine_url}: docker import of {path} failed: {error}") from error
        image_id = _import_answer(engine_url, answer)
        if existing is not None and existing != image_id:
            # The name moved to the new image: drop the old one unless a container still uses it (or it has
            # other names), so repeated forced imports do not pile up untagged root filesystems.
            with contextlib.suppress(docker.errors.APIError):
                client.api.remove_image(existing)
        seconds = time.monotonic() - started
        report(f"{engine_url}: imported {name} as {_short(image_id)} in {seconds:.1f} s")
        return ImportResult(engine_url, name, image_id, skipped=False, seconds=seconds)


def ensure_image(
    engine_urls: Iterable[str],
    name: str = DEFAULT_IMAGE,
    *,
    cache_dir: Path | str = DEFAULT_CACHE_DIR,
    mirror: str = DEFAULT_MIRROR,
    rebuild: bool = False,
    force: bool = False,
    build_progress: BuildCallback | None = None,
    import_progress: MessageCallback | None = None,
) -> EnsureReport:
    """Make ``name`` exist on every engine, building the root filesystem at most once.

    When every engine already has the image nothing is built (not even the cached tarball is needed). ``rebuild``
    re-runs debootstrap and re-imports everywhere, since a fresh tarball that no engine uses would be pointless.
    """
    engines = list(dict.fromkeys(engine_urls))
    if not engines:
        raise ImageBuildError("no Docker engine given")
    force = force or rebuild
    present: dict[str, str | None] = {}
    for url in engines:
        with _client(url) as client:
            present[url] = _image_id(client, name)
    missing = [url for url in engines if force or present[url] is None]
    report = EnsureReport(name=name, tarball=None, built=False)
    if missing:
        cached = tarball_path(name, cache_dir).is_file()
        started = time.monotonic()
        report.tarball = build_rootfs_tarball(name, cache_dir=cache_dir, mirror=mirror, rebuild=rebuild,
                                              progress=build_progress)
        report.built = rebuild or not cached
        report.build_seconds = time.monotonic() - started
    for url in engines:
        if url in missing:
            assert report.tarball is not None
            report.imports.append(import_image(url, report.tarball, name, import_progress, force=force))
        else:
            image_id = present[url] or ""
            if import_progress:
                import_progress(f"{url}: {name} already present ({_short(image_id)}), skipped")
            report.imports.append(ImportResult(url, name, image_id, skipped=True))
    return report


def image_exists(engine_url: str, name: str = DEFAULT_IMAGE) -> bool:
    """Whether the engine has an image called ``name``."""
    with _client(engine_url) as client:
        return _image_id(client, name) is not None


# -- debootstrap -------------------------------------------------------------------------------------------------


def _find_debootstrap() -> str:
    path = shutil.which("debootstrap", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if path is None:
        raise ImageBuildError("debootstrap is not installed; install it: apt-get install -y debootstrap")
    return path


def _run_debootstrap(debootstrap: str, suite: str, rootfs: Path, mirror: str, packages: Sequence[str],
                     report: BuildCallback) -> None:
    """Run debootstrap, turning its ``I:`` lines into per-phase package counts."""
    command = [debootstrap, "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs), mirror]
    env = {**os.environ, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive",
           "PATH": os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])}
    tail: deque[str] = deque(maxlen=20)
    phase, done, total = "resolve", 0, None
    retrieved = 0
    report(BuildProgress(phase, done, total, " ".join(command)))
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace", env=env)
    assert process.stdout is not None
    try:
        for raw in process.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            if match := _PACKAGE_LINE.match(line):
                if match.group(1) == "Validating":  # every package is validated once it is downloaded
                    retrieved += 1
                phase, done, total = "retrieve", retrieved, max(PACKAGE_ESTIMATE, retrieved)
            elif line.startswith("I: Extracting "):
                if phase != "extract":
                    phase, done = "extract", 0
                done += 1
                total = max(EXTRACT_ESTIMATE, done)
            elif line.startswith("I: Installing core packages"):
                phase, done = "install", 0
                total = round(retrieved * INSTALL_LINES_PER_PACKAGE)
            elif phase == "install" and _STEP_LINE.match(line):
                done += 1
                total = max(total or 0, done)
            elif line.startswith("I: Base system installed successfully"):
                done = total = max(total or 0, done)
            report(BuildProgress(phase, done, total, line))
        code = process.wait()
    except BaseException:
        process.kill()
        process.wait()
        raise
    if code != 0:
        log = _tail(rootfs / "debootstrap" / "debootstrap.log", 25)
        raise ImageBuildError(
            f"debootstrap failed (exit {code}) building {suite} from {mirror}; last output:\n"
            + "\n".join(tail) + (f"\n--- tail of debootstrap.log ---\n{log}" if log else ""))


def _shrink(rootfs: Path) -> None:
    """Drop what a sandbox never reads: downloaded .debs, apt lists, docs, man pages and translations.

    Copyright files stay (licences), and so does ``locale.alias``, which glibc reads to resolve locale names.
    Nothing here follows a symlink: an absolute link inside the root filesystem points into the host's.
    """
    keep = {"copyright", "locale.alias", "partial", "lock"}
    for directory, suffix in (("var/cache/apt/archives", ".deb"), ("var/cache/apt", ".bin"),
                              ("var/lib/apt/lists", ""), ("usr/share/man", ""), ("usr/share/info", ""),
                              ("usr/share/locale", "")):
        for entry in _entries(rootfs, directory):
            if entry.name.endswith(suffix) and entry.name not in keep:
                _remove(entry)
    for package in _entries(rootfs, "usr/share/doc"):
        if package.is_dir(follow_symlinks=False):
            for entry in _entries(rootfs, f"usr/share/doc/{package.name}"):
                if entry.name not in keep:
                    _remove(entry)


def _entries(rootfs: Path, relative: str) -> list[os.DirEntry[str]]:
    """The entries of a directory inside the root filesystem, or none if any part of its path is a symlink."""
    path = rootfs
    for part in relative.split("/"):
        path = path / part
        if path.is_symlink() or not path.is_dir():
            return []
    with os.scandir(path) as entries:
        return list(entries)


def _remove(entry: os.DirEntry[str]) -> None:
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path)
    else:
        os.unlink(entry.path)


def _write_tar(rootfs: Path, destination: Path) -> None:
    """Tar the tree with GNU tar: numeric owners, hard links and xattrs kept, virtual filesystems' contents left
    out (the engine mounts its own /dev, /proc and /sys)."""
    command = ["tar", "--create", "--file", str(destination), "--directory", str(rootfs), "--numeric-owner",
               "--xattrs", "--xattrs-include=*", "--sort=name", "--one-file-system",
               "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*", "--exclude=./run/*",
               "--exclude=./tmp/*", "--exclude=./debootstrap", "."]
    result = subprocess.run(command, check=False, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            destination.unlink()
        raise ImageBuildError(f"tar of {rootfs} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")


def _remove_tree(path: Path) -> None:
    """Remove a build directory safely: unmount anything a killed debootstrap left mounted in it (a bind-mounted
    /dev would otherwise be emptied on the host), then delete without crossing filesystems."""
    prefix = str(path.resolve()) + "/"
    with contextlib.suppress(OSError):
        mounts = [line.split()[1].replace("\\040", " ") for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], check=False, stdin=subprocess.DEVNULL, capture_output=True)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False, stdin=subprocess.DEVNULL,
                   capture_output=True)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- Docker engines ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _client(engine_url: str) -> Iterator[docker.DockerClient]:
    """A client for one engine, with the engine's unreachability turned into a one-line error."""
    try:
        client = docker.DockerClient(base_url=engine_url)
        client.api.ping()
    except docker.errors.DockerException as error:
        raise ImageBuildError(f"cannot reach the Docker engine at {engine_url}: {error}") from error
    try:
        yield client
    finally:
        client.close()


def _image_id(client: docker.DockerClient, name: str) -> str | None:
    try:
        return str(client.api.inspect_image(name)["Id"])
    except docker.errors.ImageNotFound:
        return None


def _import_answer(engine_url: str, answer: str) -> str:
    """The image id from the engine's import answer: JSON lines with ``status`` (the id) or ``error``."""
    image_id = ""
    for line in answer.splitlines():
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if "error" in message or "errorDetail" in message:
            detail = message.get("error") or message.get("errorDetail", {}).get("message")
            raise ImageBuildError(f"{engine_url}: docker import failed: {detail}")
        status = str(message.get("status", ""))
        if status.startswith("sha256:"):
            image_id = status
    if not image_id:
        raise ImageBuildError(f"{engine_url}: docker import returned no image id: {answer.strip()[:500]}")
    return image_id


def _short(image_id: str) -> str:
    return image_id.removeprefix("sha256:")[:12] or "?"
