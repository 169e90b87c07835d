"""SandboxFusion's ``POST /run_code`` on the broker, so that what already calls a SandboxFusion server (verl's
built-in code reward, ``reward.sandbox_fusion.url``) runs its code on the broker unchanged.

Each call is one ``exec`` action in a sandbox of its own, made for it and gone with it: it queues and is scheduled
like any other, ``run_timeout`` bounds the run only (``run_timeout_s``), and the answer has SandboxFusion's shape
(``status`` Success / Failed / SandboxError, ``run_result`` with status Finished / TimeLimitExceeded / Error). The
languages are those the default image carries: ``python``, ``pytest`` and ``bash``. Callers that cannot send a
header (verl's reward posts to a bare URL) may give the token as ``?token=`` and the task as ``?task=``.
"""

from __future__ import annotations

from typing import Any, Literal

from aiohttp import web
from pydantic import Field, TypeAdapter, ValidationError

from managers.cpu.exec_spec import Base64Text, FilePath
from tangram.core.action import Action, State
from tangram.core.errors import BadRequest, RequestError, Unavailable
from tangram.core.names import Name
from tangram.core.schema import Schema, parse_json
from tangram.parse import parse_action
from tangram.server.auth import own_task, principal_of
from tangram.server.common import BROKER, LIMITS, SERVER, json_response, read_body

#: per language: the file the code goes to, and the command that runs it
LANGUAGES = {"python": ("main.py", "python3 main.py"),
             "pytest": ("test_main.py", "python3 -m pytest -q -p no:cacheprovider test_main.py"),
             "bash": ("main.sh", "bash main.sh")}
#: the task of a call when neither the token nor ``?task=`` names one (an open broker)
DEFAULT_TASK = "sandbox-fusion"
#: the error codes of an action that ran and broke a limit of its own: SandboxFusion's run status for each
RUN_ENDS = {"timed_out": "TimeLimitExceeded", "out_of_memory": "Error"}
#: the exec spec's fields as the request names them, for refusals
REQUEST_FIELDS = {**{f"spec.files.{name}": "code" for name, _ in LANGUAGES.values()},
                  "spec.files": "files", "spec.memory_mb": "memory_limit_MB", "spec.stdin": "stdin",
                  "spec.run_timeout_s": "run_timeout"}
#: how much longer than its deadline a call waits for its action, which that deadline ends
WAIT_SLACK_S = 5.0
TASK_NAME: TypeAdapter[str] = TypeAdapter(Name)


class RunCodeRequest(Schema):
    """SandboxFusion's request, the fields the broker honours (``extra`` is accepted and ignored)."""

    code: str = Field(max_length=1 << 20)
    language: Literal["python", "pytest", "bash"] = "python"
    compile_timeout: float = Field(default=10.0, ge=0, description="no language here compiles: unused")
    run_timeout: float = Field(default=10.0, gt=0, le=3600, description="seconds the code may run")
    memory_limit_MB: int = Field(default=-1, description="the sandbox's memory; -1: the broker's default")
    stdin: str | None = None
    files: dict[FilePath, Base64Text | None] = Field(default_factory=dict, description="path -> base64 contents")
    fetch_files: list[str] = Field(default_factory=list, max_length=0,
                                   description="not supported: the sandbox is gone with the call")
    extra: dict[str, Any] | None = None


RUN_CODE_REQUEST = TypeAdapter(RunCodeRequest)


def exec_body(request: RunCodeRequest, task: str, deadline_s: float) -> dict[str, Any]:
    """The ``exec`` action that runs ``request``: its code and files in a fresh sandbox, one core."""
    name, command = LANGUAGES[request.language]
    files: dict[str, Any] = {path: {"base64": content} for path, content in request.files.items()
                             if content is not None}
    files[name] = request.code
    spec: dict[str, Any] = {"command": command, "files": files, "run_timeout_s": min(request.run_timeout, deadline_s)}
    if request.stdin:
        spec["stdin"] = request.stdin
    if request.memory_limit_MB > 0:
        spec["memory_mb"] = request.memory_limit_MB
    return {"task": task, "kind": "exec", "demand": {"cpu": 1}, "spec": spec, "timeout_s": deadline_s,
            "signature": f"run_code:{request.language}"}


def answer(action: Action) -> dict[str, Any]:
    """The ended action as SandboxFusion answers: Success when the code exited 0, Failed when it ran and exited
    otherwise or broke its time or memory, SandboxError when it never ran to an end of its own."""
    execution_s = action.timings().get("execution_s")
    if action.state is State.SUCCEEDED:
        result = action.result or {}
        code = result.get("exit_code")
        run = {"status": "Finished", "execution_time": execution_s, "return_code": code,
               "stdout": result.get("stdout", ""), "stderr": result.get("stderr", "")}
        return _fusion("Success" if code == 0 else "Failed", "", run)
    error = action.error or {}
    status = RUN_ENDS.get(error.get("code", "")) if execution_s is not None else None
    if status is None:
        return _fusion("SandboxError", f"{error.get('code', action.state.value)}: {error.get('message', '')}", None)
    run = {"status": status, "execution_time": execution_s, "return_code": error.get("exit_code"),
           "stdout": error.get("stdout", ""), "stderr": error.get("stderr", "")}
    return _fusion("Failed", error.get("message", ""), run)


def _fusion(status: str, message: str, run: dict[str, Any] | None) -> dict[str, Any]:
    return {"status": status, "message": message, "compile_result": None, "run_result": run,
            "executor_pod_name": None, "files": {}}


async def run_code(request: web.Request) -> web.Response:
    broker, server = request.app[BROKER], request.app[SERVER]
    body = parse_json(RUN_CODE_REQUEST, await read_body(request))
    task = own_task(_query_task(request), principal_of(request)) or DEFAULT_TASK
    try:
        action = parse_action(exec_body(body, task, server.max_wait_s), request.app[LIMITS])
        [(record, _)] = await broker.submit([action])
    except RequestError as error:  # named as the caller wrote it, not as the action it became
        error.field = next((mine + error.field[len(spec):] for spec, mine in REQUEST_FIELDS.items()
                            if error.field.startswith(spec)), error.field)
        raise
    ended = await broker.wait(record.id, server.max_wait_s + WAIT_SLACK_S)  # its own deadline ends it first
    if not ended.state.terminal:
        raise Unavailable("run_timeout", f"action {ended.id} did not end by its deadline; it goes on")
    return json_response(answer(ended))


def _query_task(request: web.Request) -> str | None:
    raw = request.query.get("task")
    if raw is None:
        return None
    try:
        return TASK_NAME.validate_python(raw)
    except ValidationError:
        raise BadRequest("task", f"is no task name: {raw!r}") from None


def add_sandbox_fusion_routes(app: web.Application) -> None:
    app.router.add_post("/run_code", run_code)
