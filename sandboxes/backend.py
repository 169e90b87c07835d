"""The sandbox seam: what the CPU manager needs from a node, whether it runs Docker or plain processes.

A *sandbox* is one trajectory environment: long-lived, memory reserved for its life, files and processes kept
between actions, and no CPU while idle. The manager only ever asks a sandbox to move to a set of cores (empty =
idle), run one command through its executor, and go away.
"""

from __future__ import annotations

import abc
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sandboxes.core_pins import CorePins
from sandboxes.exec_wire import ExecRequest, ExecResult
from sandboxes.executor import UNKNOWN_OP
from sandboxes.executor_answer import BadAnswer
from sandboxes.executor_client import ExecutorUnavailable, OutputSink, call
from sandboxes.file_wire import FileOp, FileRefused

T = TypeVar("T")

#: labels every broker-made container carries, so a restarted broker can find, adopt or reap them
LABEL_MANAGED = "org.arl-tangram.managed"
LABEL_BROKER = "org.arl-tangram.broker"
LABEL_ENV = "org.arl-tangram.environment"
LABEL_TASK = "org.arl-tangram.task"
LABEL_TRAJECTORY = "org.arl-tangram.trajectory"
LABEL_MEMORY = "org.arl-tangram.memory-mb"
LABEL_IMAGE = "org.arl-tangram.image"
LABEL_CREATED = "org.arl-tangram.created-at"
LABEL_EPHEMERAL = "org.arl-tangram.ephemeral"
#: a warm sandbox: made ahead of any trajectory; once claimed, its identity lives beside it (``sandboxes/docker.py``)
LABEL_WARM = "org.arl-tangram.warm"
#: a sandbox's egress allow-list, entries joined by ",", for a restarted broker to run its proxy again; empty (always
#: set, so that no image's label of that name stands in for it): no network
LABEL_EGRESS = "org.arl-tangram.egress"
#: a file of labels a broker wrote (a claimed warm sandbox's, a local environment's) is a few of them: anything larger
#: is not read
MAX_LABELS_BYTES = 64 * 1024


#: who runs in a sandbox unless its environment says otherwise: not root, so that a command owns nothing of the
#: host's (the sandbox's files, its executor's socket directory and /workspace belong to it)
DEFAULT_SANDBOX_USER = "1000:1000"
#: ``UID:GID`` or ``root``
SANDBOX_USER = re.compile(r"^(root|\d{1,9}:\d{1,9})\Z")


def sandbox_owner(user: str) -> tuple[int, int]:
    """The (uid, gid) a sandbox ``user`` (``SANDBOX_USER``) names."""
    if user == "root":
        return 0, 0
    uid, gid = user.split(":")
    return int(uid), int(gid)


#: the code of a node that did not answer (its agent restarts, or its host is going): not lost yet, maybe never
NODE_UNAVAILABLE = "node_unavailable"


class SandboxError(Exception):
    """A sandbox could not be created or used. ``code`` is machine-readable; ``lost`` means it is gone."""

    def __init__(self, code: str, message: str, *, lost: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.lost = lost


@dataclass(frozen=True)
class SandboxSpec:
    """How to create one environment."""

    env_id: str
    task: str
    trajectory: str | None
    image: str
    memory_mb: int
    pids_limit: int
    files: Mapping[str, bytes] = field(default_factory=dict)
    broker_id: str = "tangram"
    #: mount the root filesystem read-only (writable: the work dir and a small /tmp); Docker sandboxes only
    read_only_root: bool = False
    #: made for one action only: a restarted broker removes it instead of adopting it
    ephemeral: bool = False
    created_at: float = 0.0
    #: made ahead of any trajectory, for a warm pool (``sandboxes/warm_pool.py``)
    warm: bool = False
    #: who the executor and its commands run as in a container: ``UID:GID`` (any ids, whether or not the image
    #: names them) or ``root`` (the container's root: the host's root unless the engine remaps users)
    user: str = DEFAULT_SANDBOX_USER
    #: the most disk its writes may take, in MiB (0: no cap), where the engine's storage can cap a container
    disk_mb: int = 0
    #: None: no network at all; else the allow-list (``sandboxes/egress_policy.py``) of the HTTP(S) proxy its
    #: commands get on its loopback (``sandboxes/egress_proxy.py``)
    egress: tuple[str, ...] | None = None

    @property
    def owner(self) -> tuple[int, int]:
        """The (uid, gid) of ``user``."""
        return sandbox_owner(self.user)

    def labels(self) -> dict[str, str]:
        """Everything a restarted broker needs to adopt the sandbox as the same environment."""
        labels = {LABEL_MANAGED: "1", LABEL_BROKER: self.broker_id, LABEL_ENV: self.env_id, LABEL_TASK: self.task,
                  LABEL_MEMORY: str(self.memory_mb), LABEL_IMAGE: self.image, LABEL_CREATED: repr(self.created_at)}
        if self.trajectory is not None:
            labels[LABEL_TRAJECTORY] = self.trajectory
        if self.ephemeral:
            labels[LABEL_EPHEMERAL] = "1"
        if self.warm:
            labels[LABEL_WARM] = "1"
        labels[LABEL_EGRESS] = ",".join(self.egress or ())
        return labels


@dataclass(frozen=True)
class Leftover:
    """A trajectory environment a previous run of this broker left on a node, as its labels describe it:
    ``sandbox`` when it can be used again, else None with ``lost_reason`` (its sandbox is removed already)."""

    env_id: str
    task: str
    trajectory: str | None
    image: str
    memory_mb: int
    created_at: float
    sandbox: Sandbox | None
    lost_reason: str | None = None
    #: its egress allow-list (None: no network)
    network: tuple[str, ...] | None = None

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> Leftover:
        """The environment the labels describe, with no sandbox yet (``adopted`` or ``lost`` says which).
        Raises KeyError or ValueError on labels this version did not write."""
        memory_mb = int(labels[LABEL_MEMORY])
        if memory_mb <= 0:
            raise ValueError(f"memory {memory_mb} MiB")
        return cls(env_id=labels[LABEL_ENV], task=labels[LABEL_TASK], trajectory=labels.get(LABEL_TRAJECTORY),
                   image=labels[LABEL_IMAGE], memory_mb=memory_mb, created_at=float(labels[LABEL_CREATED]),
                   sandbox=None,
                   network=tuple(labels[LABEL_EGRESS].split(",")) if labels.get(LABEL_EGRESS) else None)

    def adopted(self, sandbox: Sandbox) -> Leftover:
        return replace(self, sandbox=sandbox)

    def lost(self, problem: str) -> Leftover:
        return replace(self, lost_reason=f"the broker restarted and the sandbox was gone: {problem}")


@dataclass(frozen=True)
class Executed:
    """What ``Sandbox.execute`` answers: the executor's result, and why the sandbox could not be narrowed or
    frozen after the command (the command's result stands; the sandbox should be taken as lost), or None."""

    result: ExecResult
    unsettled: str | None = None


class Sandbox(abc.ABC):
    """One live environment on one node."""

    #: the working directory commands run in unless they name another
    workdir: str = "/workspace"
    #: a warm sandbox claimed for its environment rather than made for it (``sandboxes/warm_pool.py``)
    claimed_warm: bool = False

    @functools.cached_property
    def _pins(self) -> CorePins:
        return CorePins()

    async def execute(self, tag: str, request: ExecRequest, on_output: OutputSink | None = None) -> Executed:
        """Run one command tagged ``tag`` on its cores: the sandbox widens to the union of its running commands'
        cores first and narrows to those still running (frozen when none) after. The command starts on the cores
        of a ``repin`` that came before it; its output goes to ``on_output`` as it comes where the sandbox can
        stream it (``stream``). Raises ``SandboxError`` as ``run`` and ``set_cores`` do, and
        ``executor_bad_answer`` for an answer out of protocol."""
        cores = self._pins.start(tag, frozenset(request.cores))  # before any await: a repin now finds it
        try:
            async with self._pins.lock:
                await self.set_cores(self._pins.union())
            pinned = replace(request, cores=tuple(sorted(cores)), tag=tag)
            result = await (self.run(pinned) if on_output is None else self.stream(pinned, on_output))
        except BadAnswer as error:
            raise SandboxError("executor_bad_answer", f"the sandbox's executor answered out of protocol: {error}") \
                from None
        finally:
            self._pins.end(tag)
            unsettled = await self._settle()
        return Executed(result, unsettled)

    async def _settle(self) -> str | None:
        try:
            async with self._pins.lock:
                await self.set_cores(self._pins.union())
        except SandboxError as error:
            return error.message
        return None

    async def files(self, op: FileOp[T]) -> T:
        """One file op through the executor (``sandboxes/file_wire.py``), holding no cores: an idle sandbox is
        thawed for it on the cpuset it last had, and frozen again after; no command starts meanwhile (the pins'
        lock). Its caller orders it with the sandbox's commands (``managers/cpu/turns.py``). Raises
        ``SandboxError``: the executor's refusal under its ``file_*`` code, or as ``run`` does."""
        async with self._pins.lock:
            idle = not self._pins.union()
            try:
                if idle:
                    await self.thaw()
                return op.answer(await self.exchange(op.to_wire(self.workdir)))
            except FileRefused as refused:
                raise SandboxError(refused.code, refused.message) from None
            except BadAnswer as error:
                raise SandboxError("executor_bad_answer", f"the sandbox's executor answered out of protocol: "
                                                          f"{error}") from None
            finally:
                if idle:
                    await self.set_cores(frozenset())

    async def thaw(self) -> None:
        """Let an idle sandbox run on the cpuset it has, holding no cores of its own (a file op); this default
        does nothing, for a backend that never freezes a sandbox."""

    async def exchange(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request to the sandbox's executor and its JSON answer (a file op's). Raise
        ``SandboxError(lost=True)`` when the executor is gone."""
        raise SandboxError("files_unsupported", f"{type(self).__name__} sandboxes offer no file ops")

    async def repin(self, tag: str, cores: frozenset[int]) -> None:
        """Move the running command tagged ``tag`` onto ``cores`` (a malleable action grew or shrank), widening or
        narrowing the sandbox with it; a command not started yet will start on them."""
        async with self._pins.lock:
            if self._pins.move(tag, cores):
                await self.set_cores(self._pins.union())
                await self.set_action_cores(tag, cores)

    @abc.abstractmethod
    async def set_cores(self, cores: frozenset[int]) -> None:
        """Let the sandbox run on exactly ``cores`` (the union of its running actions' cores); empty = idle."""

    async def set_action_cores(self, tag: str, cores: frozenset[int]) -> None:
        """Re-pin the running command tagged ``tag`` (a ``run`` request's "tag"), its whole process tree, onto
        ``cores``, which ``set_cores`` must already have given the sandbox: a malleable action grew or shrank.
        Cores sent before the command starts are the ones it starts on.

        Needed because the executor pins each command at spawn and a cgroup cpuset rewrite does not widen that
        affinity. This default does nothing, for a backend whose commands follow the cgroup. Raise
        ``SandboxError(lost=True)`` when the executor is gone, and a plain ``SandboxError`` when it refuses.
        """

    @abc.abstractmethod
    async def run(self, request: ExecRequest) -> ExecResult:
        """Run one command through the sandbox's executor and return its answer, checked and cut to the request's
        ``output_limit`` (``ExecResult.from_wire``).

        Raise ``SandboxError(lost=True)`` when the sandbox died under the command, ``BadAnswer`` for an answer out
        of protocol.
        """

    async def stream(self, request: ExecRequest, on_output: OutputSink) -> ExecResult:
        """``run``, handing the command's output to ``on_output`` while it runs (what the answer keeps, no more),
        for ``GET /v1/actions/{id}/output``. This default streams nothing: the output comes with the answer only,
        for a backend whose executor cannot stream it here (a one-shot ``docker exec``)."""
        return await self.run(request)

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Kill everything in it and free it. Idempotent."""

    def describe(self) -> dict[str, Any]:
        """What clients see about where the sandbox lives (container id, directory)."""
        return {}

    async def snapshot(self) -> str:
        """An image of its filesystem as it is now, for forks to be created from (``SandboxSpec.image``); the
        caller holds it idle (no command runs). Its backend's ``drop_snapshot`` removes it once unused."""
        raise SandboxError("fork_unsupported", f"{type(self).__name__} sandboxes cannot be forked; fork needs a "
                                               f"node with Docker sandboxes")


async def repin_via_executor(socket_path: str, tag: str, cores: frozenset[int]) -> bool:
    """``Sandbox.set_action_cores`` for a sandbox whose executor serves on ``socket_path`` (op "cpus"). Returns
    False when the executor predates the op, for the caller to decide whether its cgroup is enough."""
    try:
        answer = await call(socket_path, {"op": "cpus", "tag": tag, "cpus": sorted(cores)})
    except ExecutorUnavailable as error:
        raise SandboxError("environment_lost", f"the environment's executor is gone ({error})", lost=True) from None
    except BadAnswer as error:
        raise SandboxError("repin_failed", str(error)) from None
    if str(answer.get("error", "")).startswith(UNKNOWN_OP):  # an executor older than the op (adopted sandbox)
        return False
    if not answer.get("ok"):
        raise SandboxError("repin_failed", f"the executor did not move command {tag!r} onto cores {sorted(cores)}: "
                                           f"{answer.get('error')}")
    return True


@dataclass(frozen=True)
class NodeHardware:
    """A node's cores, the memory its environments may reserve, its NUMA groups and the processes its sandboxes may
    hold in all (0: no budget), as read on the node itself."""

    cores: tuple[int, ...]
    memory_mb: int
    numa: tuple[tuple[int, ...], ...]
    pids: int = 0


class SandboxBackend(abc.ABC):
    """Creates sandboxes on one node (one Docker engine, or this host's processes)."""

    kind: str = "backend"
    #: what the node reported about itself once started (a node behind an agent, on another host); None: the
    #: config and the broker's host say
    hardware: NodeHardware | None = None

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Create and start a sandbox, ready for ``run``; it starts idle. Raise ``SandboxError`` with a code
        (``image_not_found``, ``engine_unavailable``, ``no_python``...) a client can act on."""

    @abc.abstractmethod
    async def adopt(self, broker_id: str) -> list[Leftover]:
        """Take over the sandboxes a previous run of this broker left (it crashed): each trajectory environment that
        still runs comes back idle with its files and processes; one that died comes back as lost (and is removed),
        so its trajectory is told instead of silently starting afresh. One-action sandboxes are removed."""

    @abc.abstractmethod
    async def reap(self, broker_id: str) -> int:
        """Remove every sandbox this broker left behind (after a crash or an unclean stop); return how many."""

    async def start(self) -> None:
        """Connect and check the node is usable."""

    async def drop_snapshot(self, image: str) -> None:
        """Remove a ``Sandbox.snapshot`` image if no sandbox is created from it any more (else the last one's
        removal does); this default has none to remove."""

    async def close(self) -> None:
        """Drop connections (sandboxes are destroyed by the manager first)."""

    def prefetch(self, images: Sequence[str]) -> bool:
        """Start pulling those of ``images`` the node lacks, in the background; False if it pulls nothing (this
        default: its sandboxes use what the node has)."""
        return False

    def holds_image(self, image: str) -> bool | None:
        """Whether the node holds ``image`` as last seen, answered without a round trip (node choice prefers a node
        that need not pull it); None: this backend cannot say (local processes, a node behind an agent)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind}
