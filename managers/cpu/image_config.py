"""``[cpu.images]``: how CPU nodes get the images their sandboxes ask for (issue 38). An image a node's engine lacks
is pulled on demand (``sandboxes/image_pull.py``) from the registries ``pull_from`` allows, with the credentials of
``[cpu.images.registries."host:port"]``; a node for a new environment is chosen preferring one that holds its image;
``pre_pull`` images are pulled on every node as it starts; ``[[cpu.images.warm_pools]]`` keep warm sandboxes of
other images and memory sizes than the default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field, Strict

from managers.cpu.exec_spec import Image
from sandboxes.image_pull import ANY_REGISTRY, PullPolicy
from tangram.core.config_tables import TABLE, Count, Flag, NonNegative, PositiveSeconds, Text
from tangram.core.errors import ConfigError


@dataclass(frozen=True)
class RegistryLogin:
    """One registry's credentials: ``username`` and ``password``, or a bearer ``token``. Never logged nor shown
    (their repr leaves the secrets out)."""

    __pydantic_config__ = TABLE

    username: Text | None = None
    password: Text | None = field(default=None, repr=False)
    token: Text | None = field(default=None, repr=False)

    def auth(self) -> dict[str, str]:
        """The Docker auth config the engine pulls with."""
        if self.token is not None:
            return {"registrytoken": self.token}
        assert self.username is not None and self.password is not None
        return {"username": self.username, "password": self.password}


@dataclass(frozen=True)
class WarmPoolConfig:
    """``[[cpu.images.warm_pools]]``: ``size`` warm sandboxes of ``image`` with ``memory_mb`` on every Docker node
    on the fast path (beside ``[cpu] warm_sandboxes`` of the default image and memory)."""

    __pydantic_config__ = TABLE

    image: Image
    size: Count
    #: default: ``[cpu] default_memory_mb``
    memory_mb: NonNegative = 0


@dataclass(frozen=True)
class ImagesConfig:
    __pydantic_config__ = TABLE

    #: pull an image a node's engine lacks when a sandbox asks for it; off: such a sandbox fails ``image_not_found``
    pull: Flag = True
    #: pulls running at once on one node; more wait their turn (one pull per image, however many wait for it)
    pull_concurrency: Count = 2
    #: how long an environment waits for its image's pull before failing ``image_pull_timeout``
    pull_timeout_s: PositiveSeconds = 1800.0
    #: registries a node may pull from: "host:port", a host (any port), or "*" (any; Docker Hub is "docker.io")
    pull_from: tuple[Text, ...] = (ANY_REGISTRY,)
    #: credentials per registry ("host:port" as the image reference spells it)
    registries: dict[str, RegistryLogin] = field(default_factory=dict, repr=False)
    #: images every node pulls, in the background, as it starts
    pre_pull: tuple[Image, ...] = ()
    #: memory load a node lacking the image counts on top of its own when a new environment's node is chosen:
    #: 0 ignores where images are; 1 prefers a node holding it whenever one has room
    locality: Annotated[float, Strict(), Field(ge=0, le=1)] = 0.5
    warm_pools: tuple[WarmPoolConfig, ...] = ()

    def __post_init__(self) -> None:
        for host, login in self.registries.items():
            by_password = login.username is not None and login.password is not None
            by_token = login.token is not None and login.username is None and login.password is None
            if by_password == by_token:
                raise ConfigError(f'cpu.images.registries."{host}"', "needs username and password, or token alone")

    def policy(self) -> PullPolicy | None:
        """How nodes pull (None: they do not)."""
        if not self.pull:
            return None
        return PullPolicy(concurrency=self.pull_concurrency, timeout_s=self.pull_timeout_s, allowed=self.pull_from,
                          logins={host: login.auth() for host, login in self.registries.items()})
