"""Images pulled on demand (issue 38): a sandbox asking for an image its node's engine lacks gets it pulled first,
instead of failing ``image_not_found``. SWE-style RL uses one image per instance, and a burst of new environments on
one missing image is the common case: one pull per image and node serves them all (single flight), and at most
``concurrency`` pulls run on a node at once, so that they neither starve its disk and network nor queue behind each
other unbounded at the engine.

A registry's credentials come from the config by host; they reach the engine only inside the pull request's auth
header, never a log line, an error or a record (the engine's own messages do not carry them). Registries a node
may pull from are an allow-list, so that a deployment (or a test on a machine without the internet) can keep pulls
to its own registries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from sandboxes.backend import SandboxError

log = logging.getLogger("tangram.sandboxes.images")

#: the registry of a reference that names none (``python:3.11``, ``library/python``)
DOCKER_HUB = "docker.io"
#: what an allow-list entry says to allow every registry
ANY_REGISTRY = "*"
#: the engine's words for a pull of something the registry does not have (checked before those of a refusal:
#: Docker Hub answers "pull access denied ... does not exist" for both)
NOT_FOUND_WORDS = ("manifest unknown", "not found", "does not exist", "name unknown")
#: its words for a registry that refused the credentials (or asked for some)
DENIED_WORDS = ("unauthorized", "denied", "no basic auth credentials", "authentication required", "forbidden")

#: ``pull(image, auth)``: the engine pulls ``image`` with ``auth`` (a Docker auth config; None: none), raising
#: ``SandboxError`` (``pull_refused`` for the engine's answer)
Pull = Callable[[str, Mapping[str, str] | None], Awaitable[None]]


@dataclass(frozen=True)
class PullPolicy:
    """Whether and how a node pulls the images it lacks."""

    #: pulls running at once on the node; more wait their turn
    concurrency: int = 2
    #: how long one environment waits for its image (the pull itself goes on for those that come later)
    timeout_s: float = 1800.0
    #: registries images may be pulled from: ``host:port``, a host (any port) or ``*`` (any)
    allowed: tuple[str, ...] = (ANY_REGISTRY,)
    #: the Docker auth config (``username``/``password`` or ``registrytoken``) per registry ``host[:port]``
    logins: Mapping[str, Mapping[str, str]] = field(default_factory=dict, repr=False)

    def allows(self, registry: str) -> bool:
        host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
        return any(entry in (ANY_REGISTRY, registry, host) for entry in self.allowed)


def registry_of(image: str) -> str:
    """The registry ``host[:port]`` an image reference names, as Docker reads it: a first component with a dot or
    a port, or ``localhost``; Docker Hub otherwise."""
    first, slash, _ = image.partition("/")
    return first if slash and ("." in first or ":" in first or first == "localhost") else DOCKER_HUB


def with_tag(image: str) -> str:
    """``image`` as the engine lists it: ``:latest`` when it names neither a tag nor a digest."""
    last = image.rsplit("/", 1)[-1]
    return image if ":" in last or "@" in last else f"{image}:latest"


def pull_refused(engine: str, image: str, explanation: str) -> SandboxError:
    """The engine's refusal to pull as an error a client can act on: the image is not there, the registry refused
    (check the credentials), or anything else."""
    text = explanation.lower()
    message = f"engine {engine} could not pull {image!r}: {explanation}"
    if any(words in text for words in NOT_FOUND_WORDS):
        return SandboxError("image_not_found", message)
    if any(words in text for words in DENIED_WORDS):
        return SandboxError("image_pull_denied", f"{message} (the registry refused: check [cpu.images.registries."
                                                 f"\"{registry_of(image)}\"] in the broker's config)")
    return SandboxError("image_pull_failed", message)


class ImagePuller:
    """One node's pulls: one per image at a time, however many sandboxes wait for it, at most ``concurrency`` at
    once."""

    def __init__(self, engine: str, policy: PullPolicy, pull: Pull) -> None:
        self.engine = engine
        self.policy = policy
        self._pull = pull
        self._turns = asyncio.Semaphore(policy.concurrency)
        self._pulling: dict[str, asyncio.Future[None]] = {}
        #: pulls the engine finished
        self.pulled = 0

    @property
    def running(self) -> int:
        """Images being pulled or waiting for a turn."""
        return len(self._pulling)

    async def pull(self, image: str) -> None:
        """Have the engine pull ``image``, joining a pull of it already under way; raise ``SandboxError``
        (``image_not_found`` where the registry is not one to pull from)."""
        if image.startswith("sha256:"):  # an image id (a fork's snapshot): only ever made on its node
            raise SandboxError("image_not_found", f"engine {self.engine} has no image {image!r} (an image id, which "
                                                  f"no registry serves)")
        registry = registry_of(image)
        if not self.policy.allows(registry):
            raise SandboxError("image_not_found", f"engine {self.engine} has no image {image!r}, and {registry} is "
                                                  f"not a registry to pull from ([cpu.images] pull_from)")
        running = self._pulling.get(image)
        if running is None:
            running = self._pulling[image] = asyncio.ensure_future(self._pull_once(image, registry))
            running.add_done_callback(lambda done: self._forget(image, done))
        try:
            await asyncio.wait_for(asyncio.shield(running), self.policy.timeout_s)
        except TimeoutError:
            raise SandboxError("image_pull_timeout", f"engine {self.engine} did not pull {image!r} within "
                                                     f"{self.policy.timeout_s:.0f} s ([cpu.images] pull_timeout_s); the "
                                                     f"pull goes on for later environments") from None

    def _forget(self, image: str, done: asyncio.Future[None]) -> None:
        if self._pulling.get(image) is done:
            del self._pulling[image]
        if not done.cancelled():
            done.exception()  # read by its waiters; read here too, for when all of them timed out

    async def _pull_once(self, image: str, registry: str) -> None:
        async with self._turns:
            started = time.monotonic()
            log.info("engine %s: pulling %s", self.engine, image)
            try:
                await self._pull(image, self.policy.logins.get(registry))
            except SandboxError as error:
                log.warning("engine %s: pull of %s failed (%s): %s", self.engine, image, error.code, error.message)
                raise
            self.pulled += 1
            log.info("engine %s: pulled %s in %.1f s", self.engine, image, time.monotonic() - started)
