"""The ``spec`` of an ``exec`` action, validated at submit, and the ``ExecRequest`` built from it at run time."""

from __future__ import annotations

import binascii
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import pybase64
from pydantic import Discriminator, Field, Tag, TypeAdapter

from managers.cpu.long_tests import LONG_TESTS_ENV
from sandboxes.backend import SANDBOX_USER
from sandboxes.egress_policy import MAX_RULES, AllowList, BadRule
from sandboxes.exec_wire import ExecRequest
from tangram.core.config_tables import TABLE, Count
from tangram.core.errors import BadRequest, TooLarge, Unprocessable
from tangram.core.names import Name, json_pattern
from tangram.core.schema import NO_NUL, WHOLE, NonNegativeInteger, Schema, explained, parse, tag

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")  # \Z: "$" would let a final newline through
#: a plain pytest invocation at the start of a command or after a shell separator, not already given -n
PYTEST = re.compile(r"(^|[;&|(]\s*|\s)((?:python3?\s+-m\s+)?pytest)(?=\s|$)(?![^;&|]*\s-n\s)")
COMMAND_FORMS = "must be a non-empty shell string or a non-empty list of argument strings"
#: how an elastic pytest run uses its cores: ``tangram``, the runner the executor ships (``sandboxes/pytest_runner``:
#: one collection, forked workers that follow the cores), or ``xdist`` (``pytest -n N``, fixed at launch)
PytestRunner = Literal["tangram", "xdist"]
#: the runner's plugin module, importable from the directory the executor puts on PYTHONPATH for it
RUNNER_PLUGIN = "tangram_runner"
#: how the runner's line in a run's output starts (its BANNER)
RUNNER_BANNER = "tangram-runner:"
FILE_FORMS = 'must be text or {"base64": "..."}'


@dataclass(frozen=True)
class ExecLimits:
    """What one client may send or get back through an exec action or an environment (``[cpu.limits]``)."""

    __pydantic_config__ = TABLE

    max_command_bytes: Count = 64 << 10
    max_env_vars: Count = 256
    max_files: Count = 1000
    max_files_bytes: Count = 16 << 20
    default_output_limit: Count = 1 << 20
    max_output_limit: Count = 16 << 20
    #: bytes of ``spec.stdin`` (decoded); the executor's request frame carries them base64-encoded
    max_stdin_bytes: Count = 1 << 20
    #: environments one ``POST /v1/environments/{id}/fork`` makes at most
    max_fork: Count = 64


#: canonical base64: groups of four, padded with "=" (what the document states; ``_content_bytes``' decode accepts
#: exactly this)
BASE64 = re.compile(r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?\Z")


BASE64_REASON = "must be base64: A-Z, a-z, 0-9, + and / in groups of four, the last padded with ="
#: bytes as base64 text: the pattern is the document's only, since matching it at parse time cost more than the
#: whole decode of a MiB file (the decode checks the same, and refuses as the schema would: 400, BASE64_REASON)
Base64Text = Annotated[str, Field(json_schema_extra={"pattern": json_pattern(BASE64)})]


class Base64File(Schema):
    """A file's bytes, base64-encoded (for content that is not text)."""

    base64: Base64Text


def _user_form(value: Any) -> str | None:
    return tag("uid") if isinstance(value, int) and not isinstance(value, bool) else \
        tag("name") if isinstance(value, str) else None


def _command_form(value: Any) -> str | None:
    return tag("text") if isinstance(value, str) else tag("argv") if isinstance(value, list) else None


def _file_form(value: Any) -> str | None:
    return tag("text") if isinstance(value, str) else tag("base64") if isinstance(value, dict) else None


Command = Annotated[Annotated[str, Field(pattern=explained(r"\S", COMMAND_FORMS)), Tag(tag("text"))]
                    | Annotated[list[str], Field(min_length=1), Tag(tag("argv"))],
                    Discriminator(_command_form, custom_error_type="command_form", custom_error_message=COMMAND_FORMS)]
FileContent = Annotated[Annotated[str, Tag(tag("text"))] | Annotated[Base64File, Tag(tag("base64"))],
                        Discriminator(_file_form, custom_error_type="file_form", custom_error_message=FILE_FORMS)]
#: what the document can state of a file's path: relative, without NUL (that it stays inside the working directory
#: once normalised, "a/../b" being inside, is checked by ``inside_workdir``: 422)
FilePath = Annotated[str, Field(pattern=explained("^[^/\x00][^\x00]*$", "must be a relative path (not starting "
                                                                        "with '/'), without NUL"))]
Files = dict[FilePath, FileContent]
USER_FORMS = 'must be a uid (an integer), "UID:GID" or a user name'
#: a user name as Debian's adduser takes one, or "UID:GID"; a name is looked up in the sandbox's /etc/passwd
EXEC_USER = re.compile(r"^(\d{1,9}:\d{1,9}|[A-Za-z_][A-Za-z0-9_.-]{0,31})\Z")
#: who one command runs as (``spec.user``): resolved in the sandbox by its executor
ExecUser = Annotated[Annotated[int, Field(ge=0, le=999_999_999), WHOLE, Tag(tag("uid"))]
                     | Annotated[str, Field(pattern=explained(json_pattern(EXEC_USER), USER_FORMS)), Tag(tag("name"))],
                     Discriminator(_user_form, custom_error_type="user_form", custom_error_message=USER_FORMS)]
#: a Docker image reference as the engine parses one (distribution's grammar): ``[host[:port]/]path[:tag][@digest]``,
#: a host only where it has a dot or a port (or is localhost), the path's components lower-case, a digest of an
#: algorithm the engine knows. A bad one is refused here and never reaches the engine, which would answer an error
#: of its own (a 503 "sandbox_create_failed"), not "no such image"
_DOMAIN = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(
    rf"^(?:(?:{_DOMAIN}(?:\.{_DOMAIN})+(?::[0-9]+)?|{_DOMAIN}:[0-9]+|localhost)/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@(?:sha256:[0-9a-f]{64}|sha384:[0-9a-f]{96}|sha512:[0-9a-f]{128}))?\Z")
IMAGE_REASON = "must be a Docker image reference: [host[:port]/]name[:tag][@digest], lower-case name"
#: the engine refuses a name past 255 characters as it completes it (``docker.io/library/NAME``): 237 always fits
MAX_IMAGE_CHARS = 255 - len("docker.io/library/")
Image = Annotated[str, Field(min_length=1, max_length=MAX_IMAGE_CHARS,
                             pattern=explained(json_pattern(IMAGE_REFERENCE), IMAGE_REASON),
                             description="an image the node's engine has, as a Docker reference")]
MemoryMb = Annotated[int, Field(ge=16), WHOLE]
SANDBOX_USER_REASON = 'must be "UID:GID" or "root"'
#: who an environment's executor and commands run as (``sandboxes/backend.py``): any ids, or the container's root
SandboxUser = Annotated[str, Field(pattern=explained(json_pattern(SANDBOX_USER), SANDBOX_USER_REASON),
                                   description='"UID:GID" (the image need not name them) or "root" (weaker: the '
                                               'host\'s root unless the engine remaps users); default: [cpu] '
                                               'sandbox_user (1000:1000)')]


class NetworkBody(Schema):
    """A sandbox's network: none at all, or an HTTP(S) proxy on its own loopback that reaches the hosts listed."""

    mode: Literal["none", "proxy"] = Field(default="none", description=(
        '"none": no network (the default); "proxy": HTTP_PROXY/HTTPS_PROXY set for its commands to a proxy on its '
        'loopback that reaches only the hosts in allow (needs [cpu.egress] enabled on the broker)'))
    allow: list[str] | None = Field(default=None, description=(
        f'with "proxy", at most {MAX_RULES} entries: "host", "host:port", "*.suffix" (names below suffix) or '
        f'"*.suffix:port"; a host is a DNS name, an IPv4 address or an IPv6 address in brackets'))


def parse_network(body: NetworkBody | None, where: str) -> tuple[str, ...] | None:
    """A network spec as the sandbox's allow-list (normalised entries), or None for no network; 422 naming the
    field for an entry that is no host rule, a list too long, or a list that does not go with the mode."""
    if body is None or body.mode == "none":
        if body is not None and body.allow:
            raise Unprocessable(f"{where}.allow", 'is for mode "proxy"; mode "none" reaches nothing')
        return None
    if not body.allow:
        raise Unprocessable(f"{where}.allow", 'must list the hosts mode "proxy" may reach')
    if len(body.allow) > MAX_RULES:
        raise Unprocessable(f"{where}.allow", f"must list at most {MAX_RULES} entries")
    try:
        return AllowList.parse(body.allow).entries()
    except BadRule as error:
        raise Unprocessable(f"{where}.allow[{error.index}]", error.reason) from None


class ExecSpecBody(Schema):
    """An exec action's ``spec``: a command in the trajectory's sandbox (or a named environment)."""

    command: Command
    env: dict[Annotated[str, Field(pattern=explained(json_pattern(ENV_NAME), "names must be shell identifiers"))],
              Annotated[str, Field(pattern=NO_NUL)]] | None = None
    cwd: Annotated[str, Field(pattern=explained("^/[^\x00]*$", "must be an absolute path"))] | None = None
    environment: Name | None = Field(default=None, description="an environment id")
    image: Image | None = None
    memory_mb: MemoryMb | None = None
    sandbox_user: SandboxUser | None = None
    files: Files | None = Field(default=None, description='relative path -> text or {"base64": "..."}; written when '
                                                          'the environment is made, or in an environment that has '
                                                          'been made, before the command, once the commands running '
                                                          'there have ended')
    pytest_parallel: bool | None = None
    output_limit: NonNegativeInteger | None = Field(default=None, description="bytes of output kept")
    background: bool | None = Field(default=None, description=(
        "start the command and answer at once with its pid (result.pid, in the sandbox): it keeps running, its "
        "output discarded (redirect it to a file), until it ends, a later command kills it or the environment "
        "goes; the reap after each command spares it. It runs only while an action of its trajectory runs (an "
        "idle sandbox is frozen and holds no core), and counts against the sandbox's pids limit and memory. Needs "
        "a trajectory or an environment, on Docker sandboxes"))
    run_timeout_s: float | None = Field(default=None, gt=0, description=(
        "seconds the command may run, counted from its start in the sandbox (queueing and sandbox setup not "
        "included); past it the command is killed and the action ends timed_out with limit \"run_timeout_s\". "
        "At most the action's timeout_s, which stays the deadline from submission, queueing included"))
    stdin: FileContent | None = Field(default=None, description=(
        'the command\'s standard input: text or {"base64": "..."}, written to it and then closed (absent: '
        '/dev/null); at most [cpu.limits] max_stdin_bytes (default 1 MiB) once decoded. Not with background'))
    user: ExecUser | None = Field(default=None, description=(
        'who this command runs as: a uid, "UID:GID" or a user name of the image (looked up in its /etc/passwd when '
        'the command starts; an unknown name fails the action with exec_error). Default: the sandbox user. A '
        'Docker sandbox holds no capability to change users (root\'s are dropped too), so there it must name the '
        'environment\'s own user (422 for other ids, exec_error for another name)'))


    network: NetworkBody | None = Field(default=None, description=(
        "the network of the environment this action creates (none by default); an existing environment keeps "
        "the one it was created with"))


EXEC_SPEC = TypeAdapter(ExecSpecBody)


@dataclass(frozen=True)
class ExecSpec:
    """An exec spec as the CPU manager uses it: checked, defaults filled in, files decoded."""

    command: str | tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    environment: str | None = None
    image: str | None = None
    memory_mb: int | None = None
    sandbox_user: str | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    pytest_parallel: bool = False
    output_limit: int = 1 << 20
    background: bool = False
    #: seconds of the command's own run (None: only the action's deadline bounds it)
    run_timeout_s: float | None = None
    #: fed to the command's standard input (None: /dev/null)
    stdin: bytes | None = None
    #: a uid, "UID:GID" or a user name (None: the sandbox user)
    user: int | str | None = None
    #: the allow-list of the environment this action would create (None: no network)
    network: tuple[str, ...] | None = None


def parse_exec_spec(spec: Mapping[str, Any], limits: ExecLimits, where: str = "spec") -> ExecSpec:
    """Validate an exec spec once (at submit, or on the first use of a recovered action) into its typed value."""
    body = parse(EXEC_SPEC, spec, where)
    command = body.command if isinstance(body.command, str) else tuple(body.command)
    _check_command(command, f"{where}.command", limits)
    env = body.env or {}
    if len(env) > limits.max_env_vars:
        raise TooLarge(f"{where}.env", f"must be an object of at most {limits.max_env_vars} variables")
    output = limits.default_output_limit if body.output_limit is None else body.output_limit
    if output > limits.max_output_limit:
        raise Unprocessable(f"{where}.output_limit", f"must be an integer of bytes in [0, {limits.max_output_limit}]")
    if body.environment is not None and (body.image is not None or body.memory_mb is not None
                                         or body.sandbox_user is not None or body.network is not None):
        raise Unprocessable(f"{where}.environment", "an existing environment already has its image, memory, "
                                                    "user and network; drop image, memory_mb, sandbox_user and "
                                                    "network")
    stdin = None if body.stdin is None else _stdin(body.stdin, f"{where}.stdin", limits)
    if stdin is not None and body.background:
        raise Unprocessable(f"{where}.stdin", "a background command is answered before it reads anything; write "
                                              "its input to a file and redirect it")
    return ExecSpec(command=command, env=env, cwd=body.cwd, environment=body.environment, image=body.image,
                    memory_mb=body.memory_mb, sandbox_user=body.sandbox_user,
                    files=decode_files(body.files or {}, f"{where}.files", limits),
                    pytest_parallel=bool(body.pytest_parallel), output_limit=output,
                    background=bool(body.background), run_timeout_s=body.run_timeout_s, stdin=stdin,
                    user=body.user, network=parse_network(body.network, f"{where}.network"))


def _stdin(content: str | Base64File, where: str, limits: ExecLimits) -> bytes:
    """``spec.stdin``'s bytes; 413 past ``max_stdin_bytes``."""
    data = _content_bytes(content, where)
    if len(data) > limits.max_stdin_bytes:
        raise TooLarge(where, f"is {len(data)} bytes; the limit is {limits.max_stdin_bytes}")
    return data


def _content_bytes(content: str | Base64File, where: str) -> bytes:
    """A file's or stdin's bytes: text as UTF-8, or decoded base64 (422 when it is not)."""
    if isinstance(content, str):
        return content.encode()
    try:
        return pybase64.b64decode(content.base64, validate=True)
    except (binascii.Error, ValueError):  # a 400, as the schema's refusals are: the pattern is the document's
        raise BadRequest(f"{where}.base64", BASE64_REASON) from None


def decode_files(files: Files, where: str, limits: ExecLimits) -> dict[str, bytes]:
    """Bytes per normalised path inside the working directory; 413 past the count or size limits."""
    if len(files) > limits.max_files:
        raise TooLarge(where, f"at most {limits.max_files} files")
    decoded: dict[str, bytes] = {}
    total = 0
    for path, content in files.items():
        field_name = f"{where}.{path}"
        normal = inside_workdir(path, field_name)
        data = _content_bytes(content, field_name)
        total += len(data)
        if total > limits.max_files_bytes:
            raise TooLarge(where, f"files exceed {limits.max_files_bytes} bytes in all")
        decoded[normal] = data
    return decoded


def inside_workdir(path: str, field_name: str) -> str:
    """``path`` normalised; 422 unless it names a file inside the working directory."""
    normal = posixpath.normpath(path)
    if not path or path.startswith("/") or normal.startswith("..") or "\x00" in path or normal == ".":
        raise Unprocessable(field_name, "must be a relative path inside the working directory")
    return normal


def check_files(files: Mapping[str, bytes], where: str, limits: ExecLimits) -> None:
    """Decoded files within what ``decode_files`` lets through (count, paths, bytes): a node agent checks the
    files that reach it again, since a caller inside the cluster need not have gone through the API."""
    if len(files) > limits.max_files:
        raise TooLarge(where, f"at most {limits.max_files} files")
    for path in files:
        inside_workdir(path, f"{where}.{path}")
    if sum(len(data) for data in files.values()) > limits.max_files_bytes:
        raise TooLarge(where, f"files exceed {limits.max_files_bytes} bytes in all")


def _check_command(command: str | tuple[str, ...], where: str, limits: ExecLimits) -> None:
    parts = (command,) if isinstance(command, str) else command
    size = len(command.encode()) if isinstance(command, str) else sum(len(p.encode()) + 1 for p in parts)
    if size > limits.max_command_bytes:
        raise TooLarge(where, f"is {size} bytes; the limit is {limits.max_command_bytes}")
    if any("\x00" in p for p in parts):
        raise BadRequest(where, "must not contain NUL")


def rewrite_pytest(command: str, flags: list[str]) -> str:
    """``pytest ...`` -> ``pytest FLAGS ...`` (§5.2): test runs scale with the cores the scheduler gives them."""
    return PYTEST.sub(lambda m: f"{m.group(1)}{m.group(2)} {' '.join(flags)}", command)


def runs_pytest(spec: ExecSpec) -> bool:
    """Whether ``pytest_parallel`` has a pytest invocation to give workers to in this command."""
    if not spec.pytest_parallel:
        return False
    if isinstance(spec.command, str):
        return PYTEST.search(spec.command) is not None
    return bool(spec.command) and posixpath.basename(spec.command[0]) == "pytest" and "-n" not in spec.command


def pytest_flags(runner: PytestRunner, workers: int, cores: int, follows: bool = False) -> list[str]:
    """What an elastic ``pytest`` gets (none: it runs plain). A run whose workers follow its cores
    (``Workers.follows``) starts the runner with one worker per core, on one core too, so that it can grow. Any
    other run gets workers only for more than one: under xdist one worker costs a controller process and ~0.25 s
    more than plain pytest on the same core."""
    if runner == "tangram" and follows:
        return ["-p", RUNNER_PLUGIN, f"--tangram-workers={cores}", f"--tangram-launch-cores={cores}",
                "--tangram-long-tests"]
    if workers <= 1:
        return []
    if runner == "xdist":
        return ["-n", str(workers)]
    return ["-p", RUNNER_PLUGIN, f"--tangram-workers={workers}", f"--tangram-launch-cores={cores}",
            "--tangram-long-tests"]


def runner_report(stdout: str) -> dict[str, str | None]:
    """Which runner ran a rewritten ``pytest`` and what it said (its workers, or why it fell back to plain pytest),
    from its line in the output: ``runner`` is ``tangram``, ``plain`` or ``unknown`` (no such line: the run stopped
    before its tests, or the line was cut off by ``output_limit``)."""
    said = [line for line in stdout.splitlines() if RUNNER_BANNER in line]
    if not said:
        return {"runner": "unknown", "detail": None}
    detail = said[-1].split(RUNNER_BANNER, 1)[1].strip()
    return {"runner": "plain" if detail.startswith("plain pytest") else "tangram", "detail": detail}


def exec_request(spec: ExecSpec, cores: tuple[int, ...], timeout_s: float, workdir: str,
                 extra_env: Mapping[str, str], *, workers: int | None = None, follows: bool = False,
                 runner: PytestRunner = "tangram", long_tests: Mapping[str, float] | None = None) -> ExecRequest:
    """Elasticity at run time: ``{parallel_num}`` and ``TANGRAM_NUM_CPUS`` become the worker count (the granted
    core count unless the action is malleable, ``workers``, and started with more workers than cores, and its
    workers do not follow its cores); with ``pytest_parallel``, ``pytest`` runs on workers (``pytest_flags``), and
    the executor puts the runner's directory on PYTHONPATH where it is asked to. The runner gets the tests its
    signature's earlier runs found long (``managers.cpu.long_tests``). What it leaves running is reaped after it."""
    n = len(cores) if follows or not workers else workers
    flags = pytest_flags(runner, n, len(cores), follows) if runs_pytest(spec) else []
    command: str | tuple[str, ...]
    if isinstance(spec.command, str):
        text = spec.command.replace("{parallel_num}", str(n))
        command = rewrite_pytest(text, flags) if flags else text
    else:
        argv = [p.replace("{parallel_num}", str(n)) for p in spec.command]
        command = (*argv[:1], *flags, *argv[1:])
    with_runner = bool(flags) and runner == "tangram"
    env = {**spec.env, **extra_env, "TANGRAM_NUM_CPUS": str(n)}
    if with_runner and long_tests:
        env[LONG_TESTS_ENV] = json.dumps(dict(long_tests))
    return ExecRequest(command=command, cores=cores, env=env, cwd=spec.cwd or workdir, timeout_s=timeout_s,
                       output_limit=spec.output_limit, reap=True, background=spec.background,
                       pytest_runner=with_runner, stdin=spec.stdin, user=spec.user)
