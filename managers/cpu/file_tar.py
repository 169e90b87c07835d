"""A tar stream of files for an environment (``PUT /v1/environments/{id}/files`` as ``application/x-tar``), checked
as ``spec.files`` is before anything reaches a sandbox.

Why a tar: a large tree sent as JSON costs a third more bytes and a decode per file; a tar is what ``tar c`` gives.
Only regular files and directories are taken, each under the working directory by the same rule as ``spec.files``
(``inside_workdir``), within the same count and byte limits (directories count as files); a link, device or FIFO is
refused rather than left out, so a client learns that its tree was not written as it is. Modes keep their permission
bits only (no set-uid). The body is uncompressed, so a member's size is bounded by the body, itself bounded by
``[server] max_body_bytes``.
"""

from __future__ import annotations

import io
import tarfile

from managers.cpu.exec_spec import ExecLimits, inside_workdir
from sandboxes.file_wire import WriteFiles
from tangram.core.errors import BadRequest, TooLarge, Unprocessable

#: the permission bits a member keeps
PERMISSIONS = 0o777


def files_of_tar(raw: bytes, where: str, limits: ExecLimits) -> WriteFiles:
    """The files and directories of an uncompressed tar; 400 for a body that is no tar, 413 past the limits, 422
    for a path outside the working directory or a member that is neither a regular file nor a directory."""
    files: dict[str, bytes] = {}
    modes: dict[str, int] = {}
    dirs: dict[str, int | None] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for member in tar:
                if len(files) + len(dirs) >= limits.max_files:
                    raise TooLarge(where, f"at most {limits.max_files} files and directories")
                field = f"{where}.{member.name}"
                if _top(member.name):
                    continue  # "." or "./": the working directory itself
                path = inside_workdir(member.name, field)
                if member.isdir():
                    dirs[path] = member.mode & PERMISSIONS
                    continue
                if not member.isreg():
                    raise Unprocessable(field, "is a link, device or FIFO: only regular files and directories are "
                                               "written")
                total += member.size
                if total > limits.max_files_bytes:
                    raise TooLarge(where, f"files exceed {limits.max_files_bytes} bytes in all")
                content = tar.extractfile(member)
                assert content is not None  # a regular member always has content
                files[path] = content.read()
                modes[path] = member.mode & PERMISSIONS
    except (tarfile.TarError, EOFError) as error:
        raise BadRequest("body", f"is not an uncompressed tar: {error}") from None
    return WriteFiles(files, modes, dirs)


def _top(name: str) -> bool:
    """Whether a member names the archive's top directory itself (``tar c -C dir .`` starts with ``./``)."""
    return name.strip("/") in (".", "")
