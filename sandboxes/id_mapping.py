"""Which host ids a sandbox's ids are, on an engine run with user-namespace remapping (``--userns-remap``).

Such an engine starts every container in a user namespace whose root is an unprivileged host uid, so a process that
breaks out of its container is nobody on the host. What the broker makes on the host for a sandbox to write (the
socket directory the executor listens in, a read-only root's work dir) must then belong to the shifted ids, or the
sandbox cannot use it. The engine says it remaps (``name=userns`` among its security options) and names its data
root after the host uid and gid its containers' root maps to (``<data-root>/<uid>.<gid>``); container id ``n`` is
host id ``base + n`` while ``n`` is within the first range of the remap user's ``/etc/subuid`` (65,536 ids for the
``default`` user the engine makes itself).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from sandboxes.backend import SandboxError

_REMAPPED_ROOT = re.compile(r"(\d+)\.(\d+)")


@dataclass(frozen=True)
class IdMapping:
    """The host uid and gid of a container's root: 0 and 0 on an engine that does not remap."""

    uid_base: int = 0
    gid_base: int = 0

    @property
    def remaps(self) -> bool:
        return (self.uid_base, self.gid_base) != (0, 0)

    def on_host(self, owner: tuple[int, int]) -> tuple[int, int]:
        """The host's uid and gid for a container's ``owner``."""
        return self.uid_base + owner[0], self.gid_base + owner[1]

    @classmethod
    def of_engine(cls, engine: str, info: dict[str, Any]) -> IdMapping:
        """The mapping of the engine whose ``docker info`` answer is ``info``."""
        if "name=userns" not in (info.get("SecurityOptions") or []):
            return cls()
        root = str(info.get("DockerRootDir") or "")
        match = _REMAPPED_ROOT.fullmatch(PurePosixPath(root).name)
        if match is None:
            raise SandboxError("engine_unsupported", f"Docker engine {engine} remaps user namespaces but its data "
                                                     f"root {root!r} does not name the ids it maps root to "
                                                     f"(<uid>.<gid>): the broker cannot give its sandboxes their "
                                                     f"socket directory")
        return cls(int(match[1]), int(match[2]))
