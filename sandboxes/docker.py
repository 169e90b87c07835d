"""Sandboxes as Docker containers, one per trajectory environment, on one engine (local socket or TCP+TLS).

Two paths per action, chosen per node:

* **fast path** (engine on this host): the executor inside the container listens on a unix socket in a
  bind-mounted directory, and the broker writes the container's cgroup files itself (cpuset, CPU quota,
  freezer). No Docker API call per action.
* **engine path** (remote engines): ``docker update`` for cpuset and quota, ``docker pause``/``unpause`` for
  idling, and ``docker exec`` of the same executor in one-shot mode.

With ``read_only_root`` the container's root filesystem is mounted read-only; the work dir and the executor's
directory are anonymous volumes (removed with the container) and ``/tmp`` is a size-capped tmpfs.

The Docker SDK is synchronous; its calls run in worker threads.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import posixpath
import shutil
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import docker
import docker.errors
import orjson
import requests.exceptions
import urllib3.exceptions
from docker.models.containers import Container
from docker.tls import TLSConfig
from docker.types import LogConfig, Mount

from sandboxes.backend import (
    LABEL_BROKER,
    LABEL_ENV,
    LABEL_EPHEMERAL,
    LABEL_MANAGED,
    LABEL_WARM,
    MAX_LABELS_BYTES,
    Leftover,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    repin_via_executor,
)
from sandboxes.cgroup import CFS_PERIOD_US, ContainerCgroup, cpu_list
from sandboxes.egress_policy import AddressRules, AllowList
from sandboxes.egress_proxy import EgressProxy
from sandboxes.exec_wire import ExecRequest, ExecResult
from sandboxes.executor import PROTOCOL_VERSION
from sandboxes.executor_answer import BadAnswer, frame_limit
from sandboxes.executor_client import EXECUTOR_PATH, ExecutorUnavailable, OutputSink, call, encode_once, wait_ready
from sandboxes.executor_python import BORROWED, OWN, ExecutorPython, interpreter_of, sweep_leftovers, volume_mount
from sandboxes.id_mapping import IdMapping
from sandboxes.image_pull import ImagePuller, PullPolicy, pull_refused, with_tag
from sandboxes.untrusted_paths import UntrustedPath, read_regular
from sandboxes.warm_pool import CreateRate, WarmPools

log = logging.getLogger("tangram.sandboxes.docker")

EXECUTOR_DIR = "/opt/tangram"
EXECUTOR_IN_CONTAINER = f"{EXECUTOR_DIR}/executor.py"
SOCKET_DIR_IN_CONTAINER = "/run/tangram"
WORKDIR = "/workspace"
READY_TIMEOUT_S = 30.0
#: how long the engine may keep silent on one API call (a pull's progress included) before it counts as not answering
ENGINE_TIMEOUT_S = 60
#: how long an adopted sandbox's executor may take to answer once thawed (a ping; a stalled or hostile one costs the
#: start this long)
ADOPT_TIMEOUT_S = 1.0
#: sandboxes adopted at once
ADOPT_CONCURRENCY = 32
#: /tmp of a read-only-root sandbox: writable, executable, and counted against the container's memory limit
READ_ONLY_ROOT_TMPFS = {"/tmp": "rw,exec,nosuid,nodev,size=64m,mode=1777"}
#: how much of a one-shot executor's stderr the engine path keeps, for the message when it fails
ENGINE_STDERR_TAIL_BYTES = 4096
#: Linux caps one argv string at 128 KiB (MAX_ARG_STRLEN): a larger one-shot request (a large stdin) cannot reach
#: the executor through `docker exec`, and is refused before it would look like a dead executor
ENGINE_REQUEST_CHARS = 128 * 1024 - 1
#: in a sandbox's host directory, the subdirectory shared with it as SOCKET_DIR_IN_CONTAINER: the sandbox can write
#: there, so nothing in it is trusted (``sandboxes/untrusted_paths.py``)
SOCKET_SUBDIR = "sock"
#: in a claimed warm sandbox's host directory, beside (not in) the shared one: the labels of the trajectory
#: environment it became (its container's own labels cannot change)
CLAIM_FILE = "claimed.json"
#: the owner of a root sandbox's sealed socket directory (``DockerSandbox.seal``): nobody, so that the container's
#: root, without capabilities, cannot write there
SEALED_OWNER_OF_ROOT = 65534
#: the elastic pytest runner, beside the executor in the sandbox as in this package (the executor finds it there)
RUNNER_IN_EXECUTOR_DIR = "pytest_runner/tangram_runner.py"
#: the executor's file ops, beside it (it imports them from there)
FILES_IN_EXECUTOR_DIR = "executor_files.py"
#: the relay of a sandbox with egress (``sandboxes/egress_relay.py``), beside the executor, which starts it
RELAY_IN_EXECUTOR_DIR = "egress_relay.py"
#: in a sandbox's host directory, the one holding its egress proxy's socket, root's: mounted read-only as
#: EGRESS_DIR_IN_CONTAINER in that sandbox alone, and nothing in it is ever read by the broker
EGRESS_SUBDIR = "egress"
EGRESS_DIR_IN_CONTAINER = "/run/tangram-egress"
EGRESS_SOCKET = "proxy.sock"
#: where the relay listens on the sandbox's own loopback: its commands' HTTP(S) proxy
EGRESS_PORT = 3128
#: what a sandbox with egress runs its commands with, for the tools that honour these (curl, pip, urllib, git)
EGRESS_ENVIRONMENT = {name: f"http://127.0.0.1:{EGRESS_PORT}"
                      for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} \
    | {"NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1"}
#: the largest request the engine path passes to the executor's one-shot mode, as its one argv string (MAX_ARG_STRLEN
#: is 128 KiB), leaving room for the rest of the command line
MAX_ONCE_ARGUMENT_BYTES = 120 * 1024
#: the engine's log of a sandbox (its executor's stderr, and whatever a command writes there): one file, capped
CONTAINER_LOG = {"max-size": "1m", "max-file": "1"}
#: a fork's image (``DockerSandbox.snapshot``), and through it every container created from it: the last such
#: container's removal removes the image
LABEL_FORK = "org.arl-tangram.fork"
#: what a snapshot image must not pass on from the container it was committed from: the forks get their own
#: identity (``SandboxSpec.labels``), never the source's warm or one-action marks
SNAPSHOT_CHANGES = [f"LABEL {LABEL_FORK}=1 {LABEL_WARM}= {LABEL_EPHEMERAL}="]


@dataclass(frozen=True)
class _Tree:
    """Files to put under ``top`` (a path relative to the extraction directory, "." for itself), owned by
    ``owner``: ``top`` and every directory the files are in get an entry of the same owner, so that the sandbox's
    user can write there; the file at ``executable`` gets mode 755, the others 644."""

    top: str
    files: Mapping[str, bytes]
    owner: tuple[int, int]
    executable: str | None = None


def _archive(*trees: _Tree) -> bytes:
    """A tar of ``trees``, for ``put_archive`` (works on remote engines too)."""
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for tree in trees:
            directories = {tree.top} | {posixpath.normpath(posixpath.join(tree.top, parent))
                                        for path in tree.files for parent in _parents(path)}
            for directory in sorted(directories, key=lambda d: (d.count("/"), d)):
                info = tarfile.TarInfo(directory)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
                info.uid, info.gid = tree.owner
                tar.addfile(info)
            for path, data in tree.files.items():
                info = tarfile.TarInfo(posixpath.normpath(posixpath.join(tree.top, path)))
                info.size, info.mtime = len(data), now
                info.mode = 0o755 if path == tree.executable else 0o644
                info.uid, info.gid = tree.owner
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _parents(path: str) -> list[str]:
    """The directories ``path`` (relative) is in, below its top: ``a/b/c`` -> ``a``, ``a/b``."""
    parts = path.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _mount_source(container: Container, destination: str) -> Path | None:
    """Where on the engine's host the container's mount at ``destination`` comes from, as the engine says."""
    for mount in container.attrs.get("Mounts", []):
        if mount.get("Destination") == destination and mount.get("Source"):
            return Path(mount["Source"])
    return None


class DockerSandbox(Sandbox):
    workdir = WORKDIR

    def __init__(self, backend: DockerBackend, container: Container, host_dir: Path | None,
                 cgroup: ContainerCgroup | None, socket_dir: Path | None = None) -> None:
        """``host_dir``: the broker's directory for the sandbox on the fast path; the executor's socket is in
        ``socket_dir``, by default its shared subdirectory."""
        self.backend = backend
        self.container = container
        self.host_dir = host_dir
        self.cgroup = cgroup
        if host_dir is not None and socket_dir is None:
            socket_dir = host_dir / SOCKET_SUBDIR
        self.socket = str(socket_dir / "exec.sock") if socket_dir is not None else None
        self.frozen = False
        self.destroyed = False
        self.old_executor = False  # adopted from an older broker: its executor cannot re-pin a command
        #: its executor's protocol: this broker's for a sandbox it made, the ping's answer for one it adopted
        self.protocol = PROTOCOL_VERSION
        self.proxy: EgressProxy | None = None  # its egress proxy, when its environment has network.mode "proxy"

    @property
    def interpreter(self) -> tuple[str, ...]:
        """How its executor is started: the image's python3, or the borrowed one (``sandboxes/executor_python.py``)."""
        return interpreter_of(self.container)

    def seal(self) -> None:
        """Once its executor listens: the socket's directory becomes another user's (root's, or nobody's for a
        root sandbox) and read-only to the sandbox, and anything in it but the socket is removed. The sandbox can
        then neither fill the host's disk there nor put anything in place of its socket."""
        assert self.socket is not None
        directory = os.path.dirname(self.socket)
        user = str(self.container.attrs.get("Config", {}).get("User") or "0").split(":")[0]
        owner = SEALED_OWNER_OF_ROOT if user in ("0", "root") else 0
        os.chown(directory, owner, owner)
        os.chmod(directory, 0o755)
        for entry in os.scandir(directory):
            if entry.name != "exec.sock":
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)

    async def set_cores(self, cores: frozenset[int]) -> None:
        if self.cgroup is not None:  # 0.01 ms per write: no thread hop
            try:
                if cores:
                    self.cgroup.set_cpus(cores)
                self.cgroup.set_frozen(not cores)
            except OSError as error:
                raise SandboxError("environment_lost", f"container {self.container.short_id} is gone: {error}",
                                   lost=True) from None
            self.frozen = not cores
            return
        await self.backend.off_loop(self._update_via_engine, cores)

    def _update_via_engine(self, cores: frozenset[int]) -> None:
        try:
            if cores:
                self.container.update(cpuset_cpus=cpu_list(cores), cpu_period=CFS_PERIOD_US,
                                      cpu_quota=len(cores) * CFS_PERIOD_US)
                if self.frozen:
                    self.container.unpause()
            elif not self.frozen:
                self.container.pause()
        except docker.errors.NotFound:
            raise SandboxError("environment_lost", f"container {self.container.short_id} is gone",
                               lost=True) from None
        except docker.errors.APIError as error:  # e.g. not running any more: its cores cannot be managed
            raise SandboxError("environment_lost", f"container {self.container.short_id} cannot take its cores: "
                                                   f"{error.explanation or error}", lost=True) from None
        self.frozen = not cores

    async def set_action_cores(self, tag: str, cores: frozenset[int]) -> None:
        """Fast path: the serving executor re-pins the command's tree. Engine path: nothing, as each command runs
        under its own `docker exec` of the executor and no process keeps the tag; the cpuset rewrite of
        ``set_cores`` is all there is. The kernel clips every task's affinity to a narrowed cpuset, so a shrink
        still reaches the command, but since Linux 6.2 (cgroup v1 and v2 alike; checked on 6.18 with v1) a task
        keeps the affinity it was spawned with, intersected with the cpuset, so a grow does not reach a command
        already running there (before 6.2 a cpuset write reset every task to the whole cpuset).

        A container adopted from an older broker runs an executor without the re-pin: its cgroup alone moves the
        command then, as on the engine path."""
        if self.socket is not None and not self.old_executor and not await repin_via_executor(self.socket, tag,
                                                                                              cores):
            self.old_executor = True
            log.warning("sandbox %s runs an executor from an older broker: its commands follow the cgroup only "
                        "(a grow does not reach a running command)", self.container.short_id)

    async def run(self, request: ExecRequest) -> ExecResult:
        return await self._run(request, None)

    async def stream(self, request: ExecRequest, on_output: OutputSink) -> ExecResult:
        """Fast path: the serving executor streams. Engine path: the one-shot executor under ``docker exec``
        answers once, so the output comes with the answer only."""
        return await self._run(request, on_output)

    def _check_protocol(self, needed: int, what: str) -> None:
        if self.protocol < needed:
            raise SandboxError("executor_outdated", f"{what}: the executor in container {self.container.short_id} "
                                                    f"came with an older broker (protocol {self.protocol}, needs "
                                                    f"{needed}) and would ignore them; delete the environment and "
                                                    f"make it again")

    async def _run(self, request: ExecRequest, on_output: OutputSink | None) -> ExecResult:
        self._check_protocol(request.protocol(), "background, pytest_runner, stdin or user")
        wire = request.to_wire()
        try:
            if self.socket is not None:
                answer = await call(self.socket, wire, on_output=on_output)
            else:
                answer = await self.backend.off_loop(self._run_via_engine, wire)
        except ExecutorUnavailable as error:
            state = await self.backend.off_loop(self._state)
            raise SandboxError("environment_lost", f"the sandbox died under the command ({error}); container "
                                                   f"state: {state}", lost=True) from None
        return ExecResult.from_wire(answer, request.output_limit)

    async def thaw(self) -> None:
        """Fast path: the freezer off, the cpuset left as it is. Engine path: ``docker unpause``."""
        if self.cgroup is not None:
            try:
                self.cgroup.set_frozen(False)
            except OSError as error:
                raise SandboxError("environment_lost", f"container {self.container.short_id} is gone: {error}",
                                   lost=True) from None
        elif self.frozen:
            await self.backend.off_loop(self._unpause)
        self.frozen = False

    def _unpause(self) -> None:
        try:
            self.container.unpause()
        except docker.errors.APIError as error:
            raise SandboxError("environment_lost", f"container {self.container.short_id} cannot be thawed: "
                                                   f"{error.explanation or error}", lost=True) from None

    async def exchange(self, request: dict[str, Any]) -> dict[str, Any]:
        """A file op: through the executor's socket, or on the engine path its one-shot mode, whose request is one
        argv string (Linux caps one at 128 KiB, so larger writes need the fast path or a node agent)."""
        self._check_protocol(2, "file operations")
        return await self._exchange(request)

    async def ping(self) -> dict[str, Any]:
        """The executor's hello, with its protocol, by whichever path reaches it."""
        return await self._exchange({"op": "ping"})

    async def _exchange(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            if self.socket is not None:
                return await call(self.socket, request)
            if len(encode_once(request)) > MAX_ONCE_ARGUMENT_BYTES:
                raise SandboxError("file_too_large", f"files: more than {MAX_ONCE_ARGUMENT_BYTES * 3 // 4} bytes "
                                                     f"in one request to a sandbox on engine {self.backend.engine} "
                                                     f"(no fast path there): send fewer at a time")
            answer: dict[str, Any] = await self.backend.off_loop(self._run_via_engine, request)
            return answer
        except ExecutorUnavailable as error:
            state = await self.backend.off_loop(self._state)
            raise SandboxError("environment_lost", f"the sandbox's executor is gone ({error}); container state: "
                                                   f"{state}", lost=True) from None

    def _run_via_engine(self, request: dict[str, Any]) -> dict[str, Any]:
        """The executor in one-shot mode under ``docker exec``; its answer (stdout) is read up to the frame an
        honest executor sends for the request, its stderr up to a small tail."""
        encoded = encode_once(request)
        if len(encoded) > ENGINE_REQUEST_CHARS:
            raise SandboxError("request_too_large", f"the command's request ({len(encoded)} characters encoded, with "
                                                    f"its stdin) does not fit one argument of `docker exec`, which "
                                                    f"a remote engine's sandbox is reached by ({ENGINE_REQUEST_CHARS}"
                                                    f"); send less stdin, or write it to a file first")
        command = [*self.interpreter, EXECUTOR_IN_CONTAINER, "once", encoded, "--oom-counter", "auto", "--reap"]
        api = self.container.client.api
        limit = frame_limit(request)
        stdout, stderr = bytearray(), bytearray()
        try:
            exec_id = api.exec_create(self.container.id, command, stdout=True, stderr=True)["Id"]
            stream = api.exec_start(exec_id, stream=True, demux=True)
            try:
                for out, err in stream:
                    stdout += out or b""
                    stderr = (stderr + (err or b""))[-ENGINE_STDERR_TAIL_BYTES:]
                    if len(stdout) > limit:
                        raise BadAnswer(f"the executor in {self.container.short_id} answered with more than an "
                                        f"executor sends for this request ({limit} bytes)")
            finally:
                stream.close()
            exit_code = api.exec_inspect(exec_id)["ExitCode"]
        except docker.errors.APIError as error:
            raise ExecutorUnavailable(self.container.short_id, str(error)) from None
        if exit_code != 0 or not stdout:
            raise ExecutorUnavailable(self.container.short_id,
                                      f"executor exited {exit_code}: {stderr[-500:].decode(errors='replace')}")
        try:
            answer = orjson.loads(stdout)
        except orjson.JSONDecodeError as error:
            raise ExecutorUnavailable(self.container.short_id, f"malformed response: {error}") from None
        if not isinstance(answer, dict):
            raise ExecutorUnavailable(self.container.short_id, "malformed response: not an object")
        return answer

    def _state(self) -> str:
        try:
            self.container.reload()
        except docker.errors.NotFound:
            return "removed"
        state = self.container.attrs.get("State", {})
        if state.get("OOMKilled"):
            return "killed for exceeding its memory limit"
        return f"{state.get('Status')} (exit code {state.get('ExitCode')})"

    async def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        if self.proxy is not None:
            await self.proxy.close()
        await self.backend.off_loop(self.backend.remove, self.container, self.cgroup)
        if self.host_dir is not None:
            shutil.rmtree(self.host_dir, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        return {"container": self.container.short_id, "engine": self.backend.engine}

    async def snapshot(self) -> str:
        """``docker commit`` of the idle container, untagged: its writable layer written once, which each fork
        then has as its image's top layer (measured faster here than copying the files into each fork:
        ``loadtest/bench_fork.py``). Not paused by the engine: the caller holds the sandbox idle, frozen."""
        return str(await self.backend.off_loop(self._commit))

    def _commit(self) -> str:
        self.container.reload()
        if self.container.attrs.get("HostConfig", {}).get("ReadonlyRootfs"):
            raise SandboxError("fork_unsupported", "a read-only-root sandbox keeps its work dir in a volume, which "
                                                   "a fork cannot copy; fork needs [cpu] read_only_root = false")
        try:
            snapshot = str(self.container.commit(changes=SNAPSHOT_CHANGES, pause=False).id)
        except docker.errors.NotFound:
            raise SandboxError("environment_lost", f"container {self.container.short_id} is gone",
                               lost=True) from None
        except docker.errors.APIError as error:
            raise SandboxError("fork_failed", f"engine {self.backend.engine} could not snapshot container "
                                              f"{self.container.short_id}: {error.explanation or error}") from None
        self.backend.python.knows(snapshot, self.interpreter == OWN)  # the forks need not ask the engine again
        return snapshot


class DockerBackend(SandboxBackend):
    kind = "docker"

    def __init__(self, engine: str, *, run_dir: Path, cores: tuple[int, ...], fast_path: bool,
                 tls: TLSConfig | None = None, warm: Sequence[tuple[SandboxSpec, int]] = (),
                 creates_per_s: float = 10.0, pull: PullPolicy | None = None, runtime: str | None = None,
                 egress: AddressRules | None = None, python_from: str | None = None) -> None:
        """On the fast path, for each (template, size) in ``warm``, that many sandboxes like the template wait
        started and frozen for new trajectories (``sandboxes/warm_pool.py``); every create waits its turn under
        ``creates_per_s``. ``pull``: how to pull an image the engine lacks (None: never; its sandboxes fail
        ``image_not_found``). ``runtime``: the engine's OCI runtime for the sandboxes (e.g. gVisor's ``runsc``;
        None: the engine's default). ``python_from``: the image whose python3 the executor borrows in images without
        one (None: those are refused, ``image_without_python3``)."""
        self.engine = engine
        self.run_dir = run_dir
        self.cores = cores
        self.fast_path = fast_path
        self.tls = tls
        self.runtime = runtime
        #: the node's address rules for sandboxes with egress (None: egress is off here)
        self.egress = egress
        self.client: docker.DockerClient | None = None
        self._rate = CreateRate(creates_per_s)
        self._warm = WarmPools(warm, self._rate, self._create_pulled) \
            if fast_path and any(size for _, size in warm) else None
        self._puller = ImagePuller(engine, pull, self._engine_pull) if pull is not None else None
        #: the images the engine is known to hold, by tagged reference and id (``holds_image``)
        self._images: set[str] = set()
        self._prefetching: set[asyncio.Task[None]] = set()
        #: whether the engine's storage caps a container's disk (None: not asked yet)
        self.disk_capped: bool | None = None
        #: the host ids of the sandboxes' ids (``start`` asks the engine)
        self.ids = IdMapping()
        self.python = ExecutorPython(python_from, self.off_loop)

    async def off_loop(self, call: Any, *args: Any) -> Any:
        """``call(*args)`` on a worker thread; an engine that stopped answering (restarting, gone) becomes the
        ``engine_unavailable`` SandboxError, which clients can act on, instead of the SDK's transport errors."""
        try:
            return await asyncio.to_thread(call, *args)
        except docker.errors.APIError:
            raise
        except (requests.exceptions.RequestException, docker.errors.DockerException) as error:  # also timeouts
            raise SandboxError("engine_unavailable", f"the Docker engine {self.engine} does not answer: {error}") \
                from None

    async def start(self) -> None:
        def connect() -> docker.DockerClient:
            client = docker.DockerClient(base_url=self.engine, tls=self.tls or False, timeout=ENGINE_TIMEOUT_S)
            client.ping()
            return client
        try:
            self.client = client = await asyncio.to_thread(connect)
        except Exception as error:  # noqa: BLE001 - the SDK raises several families for an unreachable engine
            raise SandboxError("engine_unavailable", f"Docker engine {self.engine} does not answer: {error}") \
                from None
        info = await asyncio.to_thread(client.info)
        self.ids = IdMapping.of_engine(self.engine, info)
        if self.runtime is not None:
            known = info.get("Runtimes", {})
            if self.runtime not in known:
                raise SandboxError("runtime_unknown", f"Docker engine {self.engine} has no runtime {self.runtime!r} "
                                                      f"(it has {sorted(known)}): register it in the engine's "
                                                      f"config (\"runtimes\" in daemon.json; scripts/start-docker.sh "
                                                      f"shows runsc's)")
        if self.fast_path:
            self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._images = {name for image in await asyncio.to_thread(client.api.images)
                        for name in (*(image.get("RepoTags") or ()), image["Id"])}

    async def close(self) -> None:
        for task in self._prefetching:
            task.cancel()
        if self._warm is not None:
            await self._warm.close()
        if self.client is not None:
            await asyncio.to_thread(self.client.close)
            self.client = None

    def has_image(self, image: str) -> bool:
        """Whether the engine holds ``image`` now (asked of it; ``holds_image`` learns the answer)."""
        assert self.client is not None
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            self._images.discard(with_tag(image))
            return False
        self._images.add(with_tag(image))
        return True

    def holds_image(self, image: str) -> bool:
        """As last seen, without asking the engine: the images it had at start, and those asked about since."""
        return with_tag(image) in self._images or image in self._images

    def prefetch(self, images: Sequence[str]) -> bool:
        """Pull each of ``images`` the engine lacks, in the background (``[cpu.images] pre_pull``, ``POST
        /v1/images/pull``); a failure is logged by the puller and costs nothing else."""
        if self._puller is None:
            return False
        for image in images:
            task = asyncio.create_task(self._pulled(image), name=f"tangram-pre-pull-{image}")
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._prefetching.add(task)
            task.add_done_callback(self._prefetching.discard)
        return True

    async def _pulled(self, image: str) -> None:
        """Have the engine pull ``image`` first if it lacks it and pulling is on; without pulling, the engine's
        ``image_not_found`` at create stands."""
        if self._puller is not None and not await self.off_loop(self.has_image, image):
            await self._puller.pull(image)
            self._images.add(with_tag(image))

    async def _engine_pull(self, image: str, auth: Mapping[str, str] | None) -> None:
        await self.off_loop(self._pull_image, image, auth)

    def _pull_image(self, image: str, auth: Mapping[str, str] | None) -> None:
        """The engine's pull, read to its end: an error in the stream (a layer that failed) fails it too."""
        assert self.client is not None
        try:
            for event in self.client.api.pull(image, stream=True, decode=True, auth_config=dict(auth or {}) or None):
                if isinstance(event, dict) and event.get("error"):
                    raise pull_refused(self.engine, image, str(event["error"]))
        except docker.errors.APIError as error:
            raise pull_refused(self.engine, image, str(error.explanation or error)) from None
        except (requests.exceptions.ReadTimeout, urllib3.exceptions.ReadTimeoutError):  # as read before and in the stream
            raise SandboxError("image_pull_failed", f"engine {self.engine} said nothing about its pull of {image!r} "
                                                    f"for {ENGINE_TIMEOUT_S:.0f} s (a registry that does not answer?)"
                               ) from None

    async def _create_pulled(self, spec: SandboxSpec) -> DockerSandbox:
        """A warm sandbox, of an image pulled first if need be (its turn already taken)."""
        await self._pulled(spec.image)
        return await self._create(spec)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A warm sandbox given the spec's identity and files when one fits, else a new one in its turn."""
        warm = None
        if self._warm is not None:
            self._warm.start()  # for a caller that did not adopt first
            warm = self._warm.claim(spec)
        if warm is not None:
            try:
                await self.off_loop(self._hand_over, warm, spec)
                warm.claimed_warm = True
                return warm
            except (docker.errors.APIError, OSError) as error:
                log.warning("warm sandbox %s could not be handed over (%s): creating one", warm.container.short_id,
                            error)
                await warm.destroy()
        await self._pulled(spec.image)  # before its turn: a pull holds no create slot
        await self._rate.turn()
        return await self._create(spec)

    def _hand_over(self, sandbox: DockerSandbox, spec: SandboxSpec) -> None:
        """Make a claimed warm sandbox ``spec``'s environment: its identity recorded in its host directory, out of
        the sandbox's reach (read back by ``adopt``), the spec's files in its working directory."""
        assert sandbox.host_dir is not None  # warm sandboxes exist on the fast path only
        (sandbox.host_dir / CLAIM_FILE).write_bytes(orjson.dumps(spec.labels()))
        if spec.files:
            sandbox.container.put_archive(WORKDIR, _archive(_Tree(".", spec.files, spec.owner)))

    async def _create(self, spec: SandboxSpec) -> DockerSandbox:
        proxy = None
        try:
            assert self.client is not None
            python_volume = await self.python.volume_for(self.client, spec.image)
            if spec.egress is not None:
                proxy = await self._start_proxy(spec.env_id, spec.egress)
            sandbox = await self.off_loop(self._start_container, spec, python_volume)
        except BaseException:
            if proxy is not None:
                await proxy.close()
            if spec.egress is not None:
                self._forget_dir(self.run_dir / spec.env_id)
            raise
        sandbox.proxy = proxy
        try:
            if sandbox.socket is not None:
                await wait_ready(sandbox.socket, READY_TIMEOUT_S)
                await self.off_loop(sandbox.seal)
            else:
                await self.off_loop(self._check_running, sandbox.container)
            await sandbox.set_cores(frozenset())  # born idle
        except (ExecutorUnavailable, SandboxError, OSError) as error:
            logs = await self.off_loop(self._logs, sandbox.container)
            await sandbox.destroy()
            raise SandboxError("sandbox_create_failed", f"the executor in the container from {spec.image!r} never "
                                                        f"answered ({error}); container log: {logs}") from None
        return sandbox

    async def _start_proxy(self, env_id: str, egress: tuple[str, ...]) -> EgressProxy:
        """The egress proxy of ``env_id``'s sandbox, listening in its own directory before the container that
        mounts it starts (or again, for an adopted one). Needs the engine on this host (the socket is bind-mounted)
        and egress on for the node."""
        if self.egress is None or not self.fast_path:
            raise SandboxError("egress_unsupported", f"engine {self.engine} offers no egress proxy: it needs "
                                                     f"[cpu.egress] enabled and the engine on the host that runs the "
                                                     f"proxy (the broker's, or the node agent's)")
        directory = self.run_dir / env_id / EGRESS_SUBDIR
        directory.parent.mkdir(mode=0o700, exist_ok=True)
        directory.mkdir(mode=0o755, exist_ok=True)
        os.chmod(directory, 0o755)  # whatever the umask: the sandbox's user must reach the socket in it
        proxy = EgressProxy(env_id, AllowList.parse(egress), self.egress)
        try:
            await proxy.start(str(directory / EGRESS_SOCKET))
        except OSError as error:
            raise SandboxError("sandbox_create_failed", f"the egress proxy did not start: {error}") from None
        return proxy

    def _start_container(self, spec: SandboxSpec, python_volume: str | None) -> DockerSandbox:
        """``python_volume``: the volume of the executor's borrowed python3, for an image without one."""
        assert self.client is not None
        if spec.read_only_root and spec.owner != (0, 0) and not self.engine.startswith("unix://"):
            raise SandboxError("sandbox_create_failed", f"a read-only root with sandbox user {spec.user} needs the "
                                                        f"engine on the node's own host, not {self.engine}: set "
                                                        f"[cpu] sandbox_user = \"root\" or run a node agent there")
        host_dir = self.run_dir / spec.env_id if self.fast_path else None
        # On the engine path nobody connects to the socket, but the serving executor keeps the container alive.
        socket_dir = SOCKET_DIR_IN_CONTAINER if host_dir is not None else "/tmp"
        interpreter = OWN if python_volume is None else BORROWED
        command = [*interpreter, EXECUTOR_IN_CONTAINER, "serve", "--socket", f"{socket_dir}/exec.sock",
                   "--oom-counter", "auto", "--reap"]
        uid, gid = spec.owner
        environment = {"PYTHONUNBUFFERED": "1", "TANGRAM_ENVIRONMENT": spec.env_id}
        if uid != 0:  # the image may not name the user: a home it can write in
            environment["HOME"] = WORKDIR
        options: dict[str, Any] = {
            "image": spec.image, "command": command, "name": f"tangram-{spec.env_id}", "labels": spec.labels(),
            "network_mode": "none", "security_opt": ["no-new-privileges"], "cap_drop": ["ALL"],
            "pids_limit": spec.pids_limit, "mem_limit": f"{spec.memory_mb}m",
            "memswap_limit": f"{spec.memory_mb}m", "cpuset_cpus": cpu_list(self.cores), "init": True,
            "working_dir": WORKDIR, "detach": True, "user": f"{uid}:{gid}", "environment": environment,
            "log_config": LogConfig(type="json-file", config=CONTAINER_LOG)}
        if host_dir is not None:
            host_dir.mkdir(mode=0o700, exist_ok=True)
            (host_dir / SOCKET_SUBDIR).mkdir(mode=0o700, exist_ok=True)
            os.chown(host_dir / SOCKET_SUBDIR, *self.ids.on_host(spec.owner))  # the executor makes its socket there
            options["volumes"] = {str(host_dir / SOCKET_SUBDIR): {"bind": SOCKET_DIR_IN_CONTAINER, "mode": "rw"}}
            if spec.egress is not None:
                options["volumes"][str(host_dir / EGRESS_SUBDIR)] = {"bind": EGRESS_DIR_IN_CONTAINER, "mode": "ro"}
                command += ["--egress", f"{EGRESS_PORT}:{EGRESS_DIR_IN_CONTAINER}/{EGRESS_SOCKET}"]
                environment.update(EGRESS_ENVIRONMENT)
        mounts = [] if python_volume is None else [volume_mount(python_volume)]
        if spec.read_only_root:
            # The engine extracts archives into a read-only-root container only inside its volumes.
            options.update(read_only=True, tmpfs=READ_ONLY_ROOT_TMPFS)
            mounts += [Mount(WORKDIR, None), Mount(EXECUTOR_DIR, None)]
        if mounts:
            options["mounts"] = mounts
        if spec.disk_mb and self.disk_capped is not False:
            options["storage_opt"] = {"size": f"{spec.disk_mb}M"}
        if self.runtime is not None:
            options["runtime"] = self.runtime
        try:
            container = self._create_container(options)
        except docker.errors.ImageNotFound:
            self._forget_dir(host_dir)
            raise SandboxError("image_not_found", f"engine {self.engine} has no image {spec.image!r}; build the "
                                                  f"default with `tangram image build` or `docker load` yours") \
                from None
        except docker.errors.APIError as error:
            self._forget_dir(host_dir)
            hint = (f" ([cpu] disk_mb = {spec.disk_mb} is less than the image takes: this engine's storage counts "
                    f"the image in a container's disk)") if "qgroup" in str(error.explanation) else ""
            raise SandboxError("sandbox_create_failed", f"engine {self.engine} refused the container: "
                                                        f"{error.explanation or error}{hint}") from None
        try:
            if spec.read_only_root and spec.owner != (0, 0):
                self._hand_workspace(container, spec.owner)
            self._copy_in(container, spec)
            container.start()
            container.reload()
            cgroup = ContainerCgroup.of_pid(container.attrs["State"]["Pid"]) if self.fast_path else None
        except (docker.errors.APIError, OSError, KeyError) as error:
            self.remove(container, None)
            self._forget_dir(host_dir)
            explanation = getattr(error, "explanation", None) or str(error)
            code = "image_without_python3" if "python3" in explanation else "sandbox_create_failed"
            raise SandboxError(code, f"container from {spec.image!r} did not start its executor "
                                     f"(the image needs python3): {explanation}") from None
        return DockerSandbox(self, container, host_dir, cgroup)

    def _create_container(self, options: dict[str, Any]) -> Container:
        """``containers.create``, and again without the disk cap where the engine's storage cannot cap one (said
        once in the log, and in ``describe``)."""
        assert self.client is not None
        try:
            container = self.client.containers.create(**options)
        except docker.errors.APIError as error:
            explanation = str(error.explanation or error).lower()
            if "storage_opt" not in options or "storage" not in explanation or "supported" not in explanation:
                raise
            self.disk_capped = False
            log.warning("engine %s cannot cap a sandbox's disk (%s): its sandboxes run uncapped; run it with the "
                        "btrfs storage driver, or overlay2 on XFS with project quotas", self.engine,
                        error.explanation)
            container = self.client.containers.create(**{k: v for k, v in options.items() if k != "storage_opt"})
        else:
            if "storage_opt" in options:
                self.disk_capped = True
        return container

    def _hand_workspace(self, container: Container, owner: tuple[int, int]) -> None:
        """Give a read-only-root sandbox's work dir, an anonymous volume the engine makes root's, to its user. An
        archive cannot (the engine extracts no entry for the directory it extracts into), so the volume's directory
        is changed on the engine's host: this one (``_start_container`` checked)."""
        source = _mount_source(container, WORKDIR)
        if source is not None:
            os.chown(source, *self.ids.on_host(owner))

    @staticmethod
    def _copy_in(container: Container, spec: SandboxSpec) -> None:
        """Put the executor and the spec's files in the created container, before it starts."""
        executor = _Tree(".", {"executor.py": Path(EXECUTOR_PATH).read_bytes(),
                               FILES_IN_EXECUTOR_DIR: (Path(EXECUTOR_PATH).parent / FILES_IN_EXECUTOR_DIR).read_bytes(),
                               RELAY_IN_EXECUTOR_DIR: (Path(EXECUTOR_PATH).parent / RELAY_IN_EXECUTOR_DIR).read_bytes(),
                               RUNNER_IN_EXECUTOR_DIR: (Path(EXECUTOR_PATH).parent / RUNNER_IN_EXECUTOR_DIR)
                               .read_bytes()}, (0, 0), "executor.py")
        workspace = _Tree(".", spec.files, spec.owner)
        if spec.read_only_root:  # one archive per volume: the root itself refuses them
            container.put_archive(EXECUTOR_DIR, _archive(executor))
            container.put_archive(WORKDIR, _archive(workspace))
            return
        container.put_archive("/", _archive(replace(executor, top=EXECUTOR_DIR.lstrip("/")),
                                            replace(workspace, top=WORKDIR.lstrip("/"))))

    def _check_running(self, container: Container) -> None:
        container.reload()
        if container.status != "running":
            raise SandboxError("sandbox_create_failed", f"container is {container.status}")

    @staticmethod
    def _logs(container: Container) -> str:
        try:
            return container.logs(tail=20).decode(errors="replace").strip() or "(empty)"
        except docker.errors.APIError:
            return "(unavailable)"

    @staticmethod
    def _forget_dir(host_dir: Path | None) -> None:
        if host_dir is not None:
            shutil.rmtree(host_dir, ignore_errors=True)

    def remove(self, container: Container, cgroup: ContainerCgroup | None) -> None:
        """Thaw (a frozen task cannot die) and force-remove; a container already gone is fine."""
        try:
            if cgroup is not None:
                try:
                    cgroup.set_frozen(False)
                except OSError:
                    pass
            container.reload()
            if container.status == "paused":
                try:
                    container.unpause()
                except docker.errors.APIError:  # killed meanwhile ("not paused", "stopped"): remove it anyway
                    pass
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as error:
            log.warning("could not remove container %s: %s", container.short_id, error)
            return
        if container.labels.get(LABEL_FORK) == "1":
            self._drop_image(container.attrs.get("Image", ""))

    async def drop_snapshot(self, image: str) -> None:
        await self.off_loop(self._drop_image, image)

    def _drop_image(self, image: str) -> None:
        """Remove a snapshot image unless a container still uses it (the last one's removal does it then)."""
        assert self.client is not None
        try:
            self.client.images.remove(image, noprune=False)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as error:
            if error.status_code != 409:  # 409: a fork still uses it
                log.warning("could not remove snapshot image %s: %s", image, error)

    def _labelled(self, broker_id: str) -> list[Container]:
        assert self.client is not None
        return self.client.containers.list(
            all=True, ignore_removed=True, filters={"label": [f"{LABEL_MANAGED}=1", f"{LABEL_BROKER}={broker_id}"]})

    def _cgroup(self, container: Container) -> ContainerCgroup | None:
        """The container's cgroup on the fast path, None otherwise or when its process is gone."""
        pid = container.attrs.get("State", {}).get("Pid")
        if not (self.fast_path and pid):
            return None
        try:
            return ContainerCgroup.of_pid(pid)
        except OSError:
            return None

    async def adopt(self, broker_id: str) -> list[Leftover]:
        """Every container at once (at most ADOPT_CONCURRENCY): a sandbox whose executor stalls costs the start its
        own ADOPT_TIMEOUT_S, not that times the number of such sandboxes. The python3 probes and copies a killed
        broker left go too."""
        await self.off_loop(sweep_leftovers, self.client)
        containers = [c for c in await self.off_loop(self._labelled, broker_id)
                      if not self._pooled(c.labels.get(LABEL_ENV, ""))]
        turns = asyncio.Semaphore(ADOPT_CONCURRENCY)

        async def adopt_one(container: Container) -> Leftover | None:
            async with turns:
                return await self._adopt(container)
        leftovers = [left for left in await asyncio.gather(*map(adopt_one, containers)) if left is not None]
        kept = {left.sandbox.host_dir.name for left in leftovers  # host directories of the adopted sandboxes
                if isinstance(left.sandbox, DockerSandbox) and left.sandbox.host_dir is not None}
        if self.fast_path and self.run_dir.is_dir():  # socket directories of sandboxes no longer there
            for path in self.run_dir.iterdir():
                if path.name not in kept and not self._pooled(path.name):
                    shutil.rmtree(path, ignore_errors=True)
        if self._warm is not None:  # a previous run's unclaimed warm sandboxes are gone: fill the pool anew
            self._warm.start()
        return leftovers

    def _pooled(self, env_id: str) -> bool:
        """One of this run's own warm sandboxes (a second ``adopt``, after a broker re-attached)."""
        return self._warm is not None and self._warm.owns(env_id)

    def _claimed_labels(self, labels: dict[str, str]) -> dict[str, str] | None:
        """The labels of the environment a warm sandbox became (None: never claimed, or no claim a broker wrote)."""
        try:
            claimed = orjson.loads(read_regular(str(self.run_dir / labels[LABEL_ENV] / CLAIM_FILE), MAX_LABELS_BYTES))
        except (KeyError, OSError, UntrustedPath, orjson.JSONDecodeError) as error:
            if not isinstance(error, FileNotFoundError):
                log.warning("warm sandbox %s: its claim is unreadable (%s)", labels.get(LABEL_ENV), error)
            return None
        if not (isinstance(claimed, dict) and all(isinstance(v, str) for v in claimed.values())):
            log.warning("warm sandbox %s: its claim is not a broker's labels", labels.get(LABEL_ENV))
            return None
        return claimed

    def _socket_dir(self, container: Container, host_dir: Path) -> Path | None:
        """Where the adopted container's executor socket is on the host, as its engine reports the mount: the
        shared subdirectory of ``host_dir``, or ``host_dir`` itself for a sandbox made before the subdirectory was
        (whose claim, written in the shared directory, is not trusted); None for anything else."""
        source = _mount_source(container, SOCKET_DIR_IN_CONTAINER)
        return source if source in (host_dir / SOCKET_SUBDIR, host_dir) else None

    async def _adopt(self, container: Container) -> Leftover | None:
        """The container as the same environment, idle; lost (and removed) if it stopped or its executor does not
        answer; None (removed) if it served one action only, was a warm sandbox nobody claimed, or has labels this
        version did not write."""
        labels = container.labels
        cgroup = self._cgroup(container)
        host_dir = self.run_dir / labels.get(LABEL_ENV, "") if self.fast_path else None
        socket_dir = self._socket_dir(container, host_dir) if host_dir is not None else None
        if labels.get(LABEL_WARM) == "1":
            trusted = host_dir is not None and socket_dir == host_dir / SOCKET_SUBDIR
            claimed = await self.off_loop(self._claimed_labels, labels) if trusted else None
            if claimed is None:
                await self.off_loop(self.remove, container, cgroup)
                return None
            labels = claimed
        try:
            leftover = Leftover.from_labels(labels)
        except (KeyError, ValueError):
            log.warning("container %s has labels this version did not write: removed", container.short_id)
            await self.off_loop(self.remove, container, cgroup)
            return None
        if labels.get(LABEL_EPHEMERAL) == "1":
            await self.off_loop(self.remove, container, cgroup)
            return None
        state = container.attrs.get("State", {})
        problem = None
        if container.status not in ("running", "paused"):
            problem = "it stopped while the broker was down" + (
                " (killed for exceeding its memory limit)" if state.get("OOMKilled")
                else f" (exit code {state.get('ExitCode')})")
        elif self.fast_path and cgroup is None:
            problem = "its cgroup is gone"
        elif host_dir is not None and socket_dir is None:
            problem = "its executor's socket is not where this broker puts it"
        if problem is None:
            sandbox = DockerSandbox(self, container, host_dir, cgroup, socket_dir)
            try:
                if leftover.network is not None:
                    if host_dir is None or _mount_source(container, EGRESS_DIR_IN_CONTAINER) != host_dir / EGRESS_SUBDIR:
                        raise SandboxError("egress_unsupported", "its egress mount is not where this broker puts it")
                    sandbox.proxy = await self._start_proxy(leftover.env_id, leftover.network)
                await self._wake(sandbox)
                return leftover.adopted(sandbox)
            except (ExecutorUnavailable, SandboxError, docker.errors.APIError, OSError) as error:
                if sandbox.proxy is not None:
                    await sandbox.proxy.close()
                problem = f"its executor did not answer after the restart ({error})"
        await self.off_loop(self.remove, container, cgroup)
        return leftover.lost(problem)

    async def _wake(self, sandbox: DockerSandbox) -> None:
        """Thaw an adopted sandbox, check that its executor serves, and idle it again (frozen, no cores)."""
        if sandbox.cgroup is not None:
            sandbox.cgroup.set_frozen(False)
            assert sandbox.socket is not None
            hello = await wait_ready(sandbox.socket, ADOPT_TIMEOUT_S)
            await self.off_loop(sandbox.seal)
        else:
            if sandbox.container.status == "paused":
                await self.off_loop(sandbox.container.unpause)
            await self.off_loop(self._check_running, sandbox.container)
            hello = await sandbox.ping()
        protocol = hello.get("protocol")
        sandbox.protocol = protocol if isinstance(protocol, int) and not isinstance(protocol, bool) else 1
        await sandbox.set_cores(frozenset())

    async def reap(self, broker_id: str) -> int:
        if self._warm is not None:  # no warm sandbox is made after the sweep
            await self._warm.close()

        def reap_all() -> int:
            found = self._labelled(broker_id)
            for container in found:
                self.remove(container, self._cgroup(container))
            return len(found)
        count = await self.off_loop(reap_all)
        if self.fast_path and self.run_dir.is_dir():
            for leftover in self.run_dir.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)
        return count

    def describe(self) -> dict[str, Any]:
        description: dict[str, Any] = {"backend": "docker", "engine": self.engine, "fast_path": self.fast_path,
                                       "disk_capped": self.disk_capped, "userns_remap": self.ids.remaps}
        if self._warm is not None:
            description["warm_sandboxes"] = len(self._warm)
            description["warm_pools"] = self._warm.describe()
        if self._puller is not None:
            description["image_pulls"] = {"done": self._puller.pulled, "running": self._puller.running}
        return description
