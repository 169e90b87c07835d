"""The ``spec`` of an ``exec`` action, validated at submit, and the executor request built from it at run time."""

from __future__ import annotations

import base64
import binascii
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tangram.core.errors import BadRequest, TooLarge
from tangram.core.names import NAME

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")  # \Z: "$" would let a final newline through
#: a plain pytest invocation at the start of a command or after a shell separator, not already given -n
PYTEST = re.compile(r"(^|[;&|(]\s*|\s)((?:python3?\s+-m\s+)?pytest)(?=\s|$)(?![^;&|]*\s-n\s)")
SPEC_FIELDS = frozenset({"command", "env", "cwd", "environment", "image", "memory_mb", "files", "pytest_parallel",
                         "output_limit"})


@dataclass(frozen=True)
class ExecLimits:
    """What one client may send or get back through an exec action or an environment."""

    max_command_bytes: int = 64 << 10
    max_env_vars: int = 256
    max_files: int = 1000
    max_files_bytes: int = 16 << 20
    default_output_limit: int = 1 << 20
    max_output_limit: int = 16 << 20


@dataclass(frozen=True)
class ExecSpec:
    command: str | tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    environment: str | None = None
    image: str | None = None
    memory_mb: int | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    pytest_parallel: bool = False
    output_limit: int = 1 << 20


def parse_exec_spec(spec: Mapping[str, Any], limits: ExecLimits, where: str = "spec", *,
                    with_files: bool = True) -> ExecSpec:
    """Validate an exec spec. ``with_files=False`` skips decoding ``files``: at run time they are already in the
    environment (they were checked at submit and copied in when it was created)."""
    unknown = sorted(set(spec) - SPEC_FIELDS)
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]}", f"unknown field; exec specs take {sorted(SPEC_FIELDS)}")
    command = _command(spec.get("command"), f"{where}.command", limits)
    env = spec.get("env", {})
    if not isinstance(env, dict) or len(env) > limits.max_env_vars:
        raise BadRequest(f"{where}.env", f"must be an object of at most {limits.max_env_vars} variables")
    for key, value in env.items():
        if not ENV_NAME.match(key) or not isinstance(value, str) or "\x00" in value:
            raise BadRequest(f"{where}.env.{key}", "names must be shell identifiers and values strings without NUL")
    cwd = spec.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd):
        raise BadRequest(f"{where}.cwd", "must be an absolute path")
    environment = spec.get("environment")
    if environment is not None and (not isinstance(environment, str) or not NAME.match(environment)):
        raise BadRequest(f"{where}.environment", "must be an environment id")
    image = parse_image(spec.get("image"), f"{where}.image")
    memory = parse_memory_mb(spec.get("memory_mb"), f"{where}.memory_mb")
    files = parse_files(spec.get("files", {}), f"{where}.files", limits) if with_files else {}
    parallel = spec.get("pytest_parallel", False)
    if not isinstance(parallel, bool):
        raise BadRequest(f"{where}.pytest_parallel", "must be true or false")
    output = spec.get("output_limit", limits.default_output_limit)
    if isinstance(output, bool) or not isinstance(output, int) or not 0 <= output <= limits.max_output_limit:
        raise BadRequest(f"{where}.output_limit", f"must be an integer of bytes in [0, {limits.max_output_limit}]")
    if environment is not None and (image is not None or memory is not None or spec.get("files")):
        raise BadRequest(f"{where}.environment", "an existing environment already has its image, memory and "
                                                 "files; drop image, memory_mb and files")
    return ExecSpec(command=command, env=dict(env), cwd=cwd, environment=environment, image=image,
                    memory_mb=memory, files=files, pytest_parallel=parallel, output_limit=output)


def parse_image(raw: Any, where: str) -> str | None:
    if raw is not None and (not isinstance(raw, str) or not 0 < len(raw) <= 256):
        raise BadRequest(where, "must be an image name the node's engine has")
    return raw


def parse_memory_mb(raw: Any, where: str) -> int | None:
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 16):
        raise BadRequest(where, "must be an integer of at least 16")
    return raw


def parse_files(raw: Any, where: str, limits: ExecLimits) -> dict[str, bytes]:
    """``{"relative/path": "text" | {"base64": "..."}}`` -> bytes per path inside the working directory."""
    if not isinstance(raw, dict):
        raise BadRequest(where, 'must map relative paths to text or {"base64": "..."}')
    if len(raw) > limits.max_files:
        raise TooLarge(where, f"at most {limits.max_files} files")
    files: dict[str, bytes] = {}
    total = 0
    for path, content in raw.items():
        field_name = f"{where}.{path}"
        normal = posixpath.normpath(path) if isinstance(path, str) else ""
        if not path or path.startswith("/") or normal.startswith("..") or "\x00" in path or normal == ".":
            raise BadRequest(field_name, "must be a relative path inside the working directory")
        if isinstance(content, str):
            data = content.encode()
        elif isinstance(content, dict) and set(content) == {"base64"} and isinstance(content["base64"], str):
            try:
                data = base64.b64decode(content["base64"], validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(field_name, "is not valid base64") from None
        else:
            raise BadRequest(field_name, 'must be text or {"base64": "..."}')
        total += len(data)
        if total > limits.max_files_bytes:
            raise TooLarge(where, f"files exceed {limits.max_files_bytes} bytes in all")
        files[normal] = data
    return files


def _command(raw: Any, where: str, limits: ExecLimits) -> str | tuple[str, ...]:
    if isinstance(raw, str) and raw.strip():
        size = len(raw.encode())
        parts: tuple[str, ...] | str = raw
    elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
        size = sum(len(p.encode()) + 1 for p in raw)
        parts = tuple(raw)
    else:
        raise BadRequest(where, "must be a non-empty shell string or a non-empty list of argument strings")
    if size > limits.max_command_bytes:
        raise TooLarge(where, f"is {size} bytes; the limit is {limits.max_command_bytes}")
    if any("\x00" in p for p in ([parts] if isinstance(parts, str) else parts)):
        raise BadRequest(where, "must not contain NUL")
    return parts


def rewrite_pytest(command: str, n: int) -> str:
    """``pytest ...`` -> ``pytest -n N ...`` (§5.2): test runs scale with the cores the scheduler gives them."""
    return PYTEST.sub(lambda m: f"{m.group(1)}{m.group(2)} -n {n}", command)


def executor_request(spec: ExecSpec, cores: tuple[int, ...], timeout_s: float, workdir: str,
                     extra_env: Mapping[str, str], *, workers: int | None = None, tag: str | None = None
                     ) -> dict[str, Any]:
    """Elasticity at run time: ``{parallel_num}`` and ``TANGRAM_NUM_CPUS`` become the worker count (the granted
    core count unless the action is malleable and started with more workers than cores). ``pytest`` becomes
    ``pytest -n N`` only for N > 1: one worker under xdist costs a controller process and ~0.25 s more than plain
    pytest on the same core. ``tag`` names the command for a later re-pin (``op: cpus``)."""
    n = workers or len(cores)
    if isinstance(spec.command, str):
        text = spec.command.replace("{parallel_num}", str(n))
        command: str | list[str] = rewrite_pytest(text, n) if spec.pytest_parallel and n > 1 else text
    else:
        command = [p.replace("{parallel_num}", str(n)) for p in spec.command]
        if spec.pytest_parallel and n > 1 and command and posixpath.basename(command[0]) == "pytest" \
                and "-n" not in command:
            command[1:1] = ["-n", str(n)]
    env = {**spec.env, **extra_env, "TANGRAM_NUM_CPUS": str(n)}
    request = {"op": "run", "command": command, "env": env, "cwd": spec.cwd or workdir, "timeout_s": timeout_s,
               "output_limit": spec.output_limit, "cpus": list(cores)}
    if tag is not None:
        request["tag"] = tag
    return request
