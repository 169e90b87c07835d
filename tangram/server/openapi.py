"""The OpenAPI 3 document served at ``/openapi.json``; limits come from the running config."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from tangram.config import ServerConfig
from tangram.core.schema import RequestJsonSchema
from tangram.parse import FLAGS, Limits, action_types
from tangram.records import (
    ActionRecord,
    CreatedToken,
    Drained,
    EnvironmentRecord,
    Profiles,
    Resources,
    ServiceRecord,
    SloPlans,
    StatusHistory,
    TokenRecord,
)
from tangram.server.auth import ADMIN_ROUTES, TOKEN_REQUEST
from tangram.server.environment_files_api import FilesRequest
from tangram.server.environment_fork_api import ForkRequest
from tangram.server.environments_api import EnvironmentRequest
from tangram.server.images_api import PrePullRequest
from tangram.server.openapi_environment_paths import environment_paths
from tangram.server.openapi_parts import error, json_answer, over_cap, ref, request_body
from tangram.server.sandbox_fusion_api import TASK_NAME, RunCodeRequest
from tangram.slo.plan import SloPlan

#: what a record answered by a submit leads to; the fuzzer's stateful runs follow these (submit -> get -> cancel)
ACTION_LINKS = {name: {"operationId": operation, "parameters": {"id": "$response.body#/id"}}
                for name, operation in (("GetAction", "getAction"), ("CancelAction", "cancelAction"),
                                        ("ReleaseLease", "releaseLease"))}
#: request examples, on the default config's resources: shown where this broker has every resource one demands
ACTION_EXAMPLES: dict[str, dict[str, Any]] = {
    "lease": {"summary": "two units of a quota until DELETE /v1/leases/{id}, or 1 s",
              "value": {"task": "demo", "kind": "lease", "demand": {"lease.local": 2}, "spec": {"ttl_s": 1}}},
    "exec": {"summary": "a shell command in the trajectory's sandbox",
             "value": {"task": "demo", "trajectory": "traj-1", "kind": "exec", "demand": {"cpu": 1},
                       "spec": {"command": "echo hello"}, "timeout_s": 60}},
    "elastic-exec": {"summary": "1 or 2 cores, durations by the efficiency curve",
                     "value": {"task": "demo", "trajectory": "traj-1", "kind": "exec",
                               "demand": {"cpu": {"min": 1, "max": 2}},
                               "elasticity": {"resource": "cpu", "t1": 1.0, "efficiency": {"1": 1.0, "2": 0.9}},
                               "spec": {"command": "echo {parallel_num}"}, "timeout_s": 60}},
    "api": {"summary": "a call proxied to the resource's upstream",
            "value": {"task": "demo", "kind": "api", "demand": {"api.search": 1},
                      "spec": {"method": "GET", "path": "/search", "query": {"q": "x"}}}},
}


#: the answers' schemas, generated from ``tangram.records``
RESPONSES: tuple[type[BaseModel], ...] = (ActionRecord, EnvironmentRecord, ServiceRecord, StatusHistory, Resources,
                                          Profiles, TokenRecord, CreatedToken, Drained, SloPlans)


def _request_schemas(limits: Limits, server: ServerConfig, resources: Sequence[str], *,
                     task_required: bool) -> dict[str, Any]:
    """The batch body's schema with every request type under ``$defs``, generated from the parser's own types.
    Added here is only what the types cannot know: the resources this broker has, the batch bound of ``[server]``
    and, without auth, that ``task`` is required (a task token fills it in)."""
    batch = action_types(limits)[1].json_schema(ref_template="#/components/schemas/{model}",
                                                   schema_generator=RequestJsonSchema)
    batch["properties"]["actions"]["maxItems"] = server.max_batch
    action = batch["$defs"]["Action"]
    if resources:
        action["properties"]["demand"]["propertyNames"] = {"enum": sorted(resources)}
    _with_task(action, task_required)
    return batch


def _with_task(schema: dict[str, Any], required: bool) -> dict[str, Any]:
    """Without auth nothing fills ``task`` in: the request must give it."""
    if required:
        schema["required"] = ["task", *schema.get("required", [])]
        schema["properties"]["task"] = schema["properties"]["task"]["anyOf"][0]
    return schema


def _generated(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    """``model``'s schema, its referenced types added to ``schemas``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", schema_generator=RequestJsonSchema)
    schemas.update(schema.pop("$defs", {}))
    return schema


def _tagged_by_kind(action: dict[str, Any], specs: Mapping[str, type[BaseModel]]) -> dict[str, Any]:
    """Per kind, the action with its kind's spec type (required where the type has required fields), and
    ``Action`` as their union tagged by ``kind``; the spec types themselves, generated from the managers' models."""
    if not specs:
        return {}
    refs, defs = models_json_schema([(model, "validation") for model in specs.values()],
                                    ref_template="#/components/schemas/{model}", schema_generator=RequestJsonSchema)
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    mapping = {}
    for kind, model in sorted(specs.items()):
        variant = copy.deepcopy(action)
        variant["title"] = f"{kind} action"
        variant["properties"]["kind"] = {"type": "string", "const": kind}
        spec = refs[(model, "validation")]
        if any(field.is_required() for field in model.model_fields.values()):
            variant["properties"]["spec"] = spec
            variant["required"].append("spec")
        else:
            variant["properties"]["spec"] = {"anyOf": [spec, {"type": "null"}]}
        name = f"{kind.capitalize()}Action"
        schemas[name] = variant
        mapping[kind] = f"#/components/schemas/{name}"
    schemas["Action"] = {"oneOf": [{"$ref": ref} for ref in mapping.values()],
                         "discriminator": {"propertyName": "kind", "mapping": mapping}}
    return schemas


def _memory_bound(schemas: dict[str, Any], max_memory_mb: int | None) -> str:
    """State the largest node's memory as the maximum of every ``memory_mb`` a request may give (a sandbox must fit
    one node); returns the sentence the operations add to their 422. The bound is the nodes' of the moment: nodes
    that join or leave (Ray) change it."""
    if max_memory_mb is None:
        return "memory_mb beyond any node's"
    for name in ("ExecSpecBody", "EnvironmentRequest"):
        field = schemas.get(name, {}).get("properties", {}).get("memory_mb")
        for form in field["anyOf"] if field is not None else ():
            if form.get("type") == "integer":
                form["maximum"] = max_memory_mb
    return f"memory_mb beyond the largest node's {max_memory_mb} MiB (its maximum in the schema)"


def _secure(paths: dict[str, Any], public_status: bool) -> None:
    """Bearer auth on every operation but the open ones, with its 401 and, where a token may not do it, 403."""
    open_paths = {"/healthz", "/readyz", "/openapi.json"} | (STATUS_PATHS if public_status else set())
    forbidden = {("/v1/actions", "post"): "task names another task than the token's",
                 ("/v1/actions:batch", "post"): "an action's task names another task than the token's",
                 ("/v1/environments", "post"): "task names another task than the token's",
                 ("/v1/environments", "get"): "task names another task than the token's",
                 ("/v1/images/pull", "post"): "task names another task than the token's",
                 ("/run_code", "post"): "?task= names another task than the token's",
                 ("/v1/profiles", "get"): "task names another task than the token's"}
    for path, operations in paths.items():
        for method, operation in operations.items():
            if path in open_paths:
                operation["security"] = []
                continue
            operation["responses"]["401"] = {**error("no token, or one the broker does not know"), "headers": {
                "WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}}}
            if path.startswith("/v1/admin/") or path in ADMIN_ROUTES or path == "/metrics":
                operation["responses"]["403"] = error("needs an admin token")
            elif (path, method) in forbidden:
                operation["responses"]["403"] = error(forbidden[(path, method)])


def _guarded(paths: dict[str, Any], secured: bool) -> None:
    """The answers of ``tangram.server.request_guard``: 415 for a body not declared JSON wherever a body is taken; while
    auth is off, 403 for a request addressed to a name, or sent from a page, that is not loopback."""
    for operations in paths.values():
        for operation in operations.values():
            responses = operation["responses"]
            if "requestBody" in operation:
                responses["415"] = error("a body without Content-Type: application/json")
            if not secured:
                responses.setdefault("403", error("auth is off, and Host or Origin names another host than "
                                                   "localhost, 127.0.0.1 or [::1]"))


def _admin_paths(server: ServerConfig) -> dict[str, Any]:
    token, created, plans = ref("TokenRecord"), ref("CreatedToken"), ref("SloPlans")
    task = {"name": "task", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/admin/drain": {"post": {
            "operationId": "drain", "summary": "Stop taking and starting actions until a restart; wait for running ones",
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "properties": {
                    "timeout_s": {"type": "number", "minimum": 0, "maximum": server.max_wait_s,
                                  "default": server.drain_s}}}}}},
            "responses": {"200": json_answer(ref("Drained"), "still running at the bound, and queued"),
                          "400": error("bad timeout_s")}}},
        "/v1/admin/reload": {"post": {
            "operationId": "reload", "summary": "Re-read tokens and per-task caps ([auth], [tasks]) from the config "
                                                "file and the store, and admit the reward services [gpu] adds",
            "responses": {"200": json_answer({"type": "object"}, "what was reloaded, and the services added (each "
                                                           "served once prepared)"),
                          "409": error("a change only a restart makes (a node, a running service), or changed "
                                        "SLO plans under which a task's SLO would break; nothing changed"),
                          "422": error("the config file does not parse, or an added service does not fit; nothing "
                                        "changed")}}},
        "/v1/admin/tokens": {
            "post": {"operationId": "createToken", "summary": "Make a token for a task or the admin (shown once)",
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": TOKEN_REQUEST.json_schema(schema_generator=RequestJsonSchema)}}},
                     "responses": {"201": json_answer(created, "the token, which is kept only as its SHA-256"),
                                   "400": error("neither or both of task and admin")}},
            "get": {"operationId": "listTokens", "summary": "Tokens from the config and the store (never a hash)",
                    "responses": {"200": json_answer({"type": "object", "required": ["tokens"], "properties": {
                        "tokens": {"type": "array", "items": token}}}, "tokens")}}},
        "/v1/admin/tokens/{id}": {"delete": {
            "operationId": "revokeToken", "summary": "Revoke a stored token at once",
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": json_answer(token, "the revoked token"), "404": error("unknown id"),
                          "409": error("a config token: remove it from the file and reload")}}},
        "/v1/tasks/slo": {"get": {
            "operationId": "listSloPlans", "summary": "Every task's SLO plan, its predicted slowdown in the GPU pool "
                                                      "and its measured attainment",
            "responses": {"200": json_answer(plans, "the planned tasks")}}},
        "/v1/tasks/{task}/slo": {
            "put": {"operationId": "putSloPlan", "summary": "Admit a task's SLO plan if every task's SLO still holds",
                    "parameters": [task],
                    "requestBody": {"required": True, "content": {"application/json": {"schema": TypeAdapter(
                        SloPlan).json_schema(schema_generator=RequestJsonSchema)}}},
                    "responses": {"200": json_answer(plans, "admitted (kept in the store); every task's prediction"),
                                  "400": error("the body is not JSON, or a field is missing, unknown or out of "
                                                "range"),
                                  "409": error("a task's SLO would break (the body names it, its predicted_slowdown "
                                                "and slo), or the task's plan is in the config; nothing changed"),
                                  "422": error("a service the GPU manager does not serve, or no GPU pool"),
                                  "503": error("the database is unavailable; nothing changed")}},
            "delete": {"operationId": "deleteSloPlan", "summary": "Remove a task's SLO plan made through the API",
                       "parameters": [task],
                       "responses": {"204": {"description": "removed"}, "404": error("no plan made through the API"),
                                     "409": error("the task's plan is in the config"),
                                     "503": error("the database is unavailable; nothing changed")}}},
    }


#: SandboxFusion's answer to ``/run_code`` (``tangram/server/sandbox_fusion_api.py``)
RUN_CODE_ANSWER = {"type": "object", "required": ["status", "message", "run_result"], "properties": {
    "status": {"enum": ["Success", "Failed", "SandboxError"]}, "message": {"type": "string"},
    "compile_result": {"type": "null"}, "executor_pod_name": {"type": "null"}, "files": {"type": "object"},
    "run_result": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["status"], "properties": {
        "status": {"enum": ["Finished", "TimeLimitExceeded", "Error"]},
        "execution_time": {"type": ["number", "null"]}, "return_code": {"type": ["integer", "null"]},
        "stdout": {"type": "string"}, "stderr": {"type": "string"}}}]}}}


#: status routes, open without a token while ``[auth] public_status`` is true
STATUS_PATHS = {"/", "/ui", "/v1/status/history", "/v1/resources", "/metrics"}


def openapi_document(server: ServerConfig, limits: Limits, resources: Sequence[str] = (),
                     specs: Mapping[str, type[BaseModel]] | None = None, *, secured: bool = False,
                     public_status: bool = True, max_memory_mb: int | None = None,
                     max_fork: int | None = None) -> dict[str, Any]:
    """``resources``: the names this broker has; a demand naming another is a 400, so the document lists them.
    ``specs``: the spec type of each kind this broker executes (its managers' ``spec_types``); an action is then
    one of those kinds, tagged by ``kind``. ``max_memory_mb``: the largest CPU node's memory, the most a sandbox
    may reserve; ``max_fork``: the most forks one request makes (None: no CPU manager).
    ``secured``: auth is on, so the document has bearer auth, its 401/403 answers and the admin endpoints."""
    id_param = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    wait_params = [
        {"name": "wait", "in": "query", "schema": {"type": "string", "enum": list(FLAGS)},
         "description": "block until the action is terminal or wait_timeout_s passes"},
        {"name": "wait_timeout_s", "in": "query",
         "schema": {"type": "number", "minimum": 0, "maximum": server.max_wait_s}},
    ]
    batch = _request_schemas(limits, server, resources, task_required=not secured)
    request_types = batch.pop("$defs")
    schemas_out: dict[str, Any] = {}
    schemas: dict[str, Any] = {
        **request_types,
        **_tagged_by_kind(request_types["Action"], specs or {}),
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["field", "reason"],
            "properties": {"field": {"type": "string"}, "reason": {"type": "string"}}}}},
        "EnvironmentRequest": _with_task(_generated(EnvironmentRequest, schemas_out), required=not secured),
        "FilesRequest": _generated(FilesRequest, schemas_out),
        "ForkRequest": _generated(ForkRequest, schemas_out),
        "PrePullRequest": _with_task(_generated(PrePullRequest, schemas_out), required=not secured),
        "RunCodeRequest": _generated(RunCodeRequest, schemas_out),
        **{model.__name__: _generated(model, schemas_out) for model in RESPONSES},
    }
    schemas.update(schemas_out)
    too_much_memory = _memory_bound(schemas, max_memory_mb)
    record = json_answer(ref("ActionRecord"), "the action record")
    examples = {name: example for name, example in ACTION_EXAMPLES.items()
                if set(example["value"]["demand"]) <= set(resources)}
    batch_examples = {"batch": {"summary": "every example above in one request", "value": {
        "actions": [example["value"] for example in examples.values()]}}} if examples else {}
    environment_examples = {"sandbox": {"summary": "a sandbox for a trajectory, with a file", "value": {
        "task": "demo", "trajectory": "traj-2", "files": {"notes.txt": "hello"}}}} if "cpu" in resources else {}
    submit_errors = {"400": error("does not match the schemas"),
                     "404": error("unknown spec.environment or reward service"),
                     "409": error("spec.environment is lost, or idempotency_key was used for another request "
                                   "(the body names the action it holds)"),
                     "413": error("body, command or files too large"),
                     "422": error(f"matches the schemas but breaks a rule they cannot state (min <= max, the "
                                   f"elasticity resource in the demand, an exec demands cpu, a reward input fits the "
                                   f"service's task), or can "
                                   f"never run here ({too_much_memory}, more units than any pool has)"),
                     "429": over_cap("the task is at a cap (max_queued, max_queued_bytes, max_environments, "
                                      "max_memory_mb; the "
                                      "body's cap names it), or a new sandbox would exceed cpu.max_environments"),
                     "503": error("queue full, or the broker is shutting down")}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "ARL-Tangram broker", "version": "0.1.0",
                 "description": "Action-level resource broker for agentic RL."},
        "paths": {
            "/v1/actions": {"post": {
                "operationId": "submitAction", "summary": "Submit one action", "parameters": wait_params,
                "requestBody": {"required": True, "content": {"application/json": request_body(ref("Action"), examples)}},
                "responses": {"201": json_answer(ref("ActionRecord"), "queued", ACTION_LINKS),
                              "200": json_answer(ref("ActionRecord"), "terminal record (wait) or idempotent replay",
                                           ACTION_LINKS),
                              "202": json_answer(ref("ActionRecord"), "wait timed out; record as it stands", ACTION_LINKS),
                              **submit_errors}}},
            "/v1/actions:batch": {"post": {
                "operationId": "submitBatch",
                "summary": "Submit many actions; all are validated before any is queued",
                "requestBody": {"required": True, "content": {"application/json": request_body(
                    batch, batch_examples)}},
                "responses": {"200": json_answer({"type": "object", "required": ["actions", "created"], "properties": {
                    "actions": {"type": "array", "items": ref("ActionRecord")},
                    "created": {"type": "integer"}}}, "records in request order"),
                    **submit_errors, "400": error("invalid action, field prefixed actions[i]."),
                    "413": error("more than max_batch actions, or a body, command or files too large")}}},
            "/v1/actions/{id}": {
                "get": {"operationId": "getAction", "summary": "Get an action record",
                        "parameters": [id_param, *wait_params],
                        "responses": {"200": record, "400": error("bad query"), "404": error("unknown id")}},
                "delete": {"operationId": "cancelAction", "summary": "Cancel a queued or running action",
                           "parameters": [id_param],
                           "responses": {"200": record, "404": error("unknown id"),
                                         "409": error("already terminal")}}},
            "/v1/actions/{id}/output": {"get": {
                "operationId": "streamActionOutput",
                "summary": "Stream an exec action's stdout and stderr while it runs (server-sent events)",
                "description": "Events: `stdout` and `stderr`, each `data: {\"data\": TEXT}` with the next piece of "
                               "that stream (its bytes decoded as UTF-8 with replacement; at most the action's "
                               "output_limit bytes per stream in all), then one `end`, `data: {\"id\", \"state\", "
                               "\"exit_code\", \"error\": {\"code\", \"message\"} or null}`, and the stream "
                               "closes. A queued action's stream waits for its command to start (`: waiting` "
                               "comments meanwhile); an ended action, or one whose sandbox cannot stream, sends its "
                               "record's kept output before `end`. Dropping the stream does not cancel the action.",
                "parameters": [id_param],
                "responses": {"200": {"description": "the output as it comes, then end",
                                      "content": {"text/event-stream": {"schema": {  # one event (before 3.2)
                                          "type": "object", "required": ["event", "data"],
                                          "properties": {"event": {"enum": ["stdout", "stderr", "end"]},
                                                         "data": {"type": "string",
                                                                  "contentMediaType": "application/json"}}}}}},
                              "404": error("unknown id"),
                              "409": error("not an exec action: it has no output stream")}}},
            "/v1/leases/{id}": {"delete": {
                "operationId": "releaseLease", "summary": "Return a granted lease's units", "parameters": [id_param],
                "responses": {"200": record, "404": error("unknown id, or an action that is not a lease"),
                              "409": error("not held")}}},
            "/v1/profiles": {
                "get": {"operationId": "listProfiles",
                        "summary": "Learned duration profiles per (task, action signature), most observed first",
                        "parameters": [{"name": "task", "in": "query", "required": False, "schema": {"type": "string"}},
                                       {"name": "limit", "in": "query", "required": False,
                                        "schema": {"type": "integer", "minimum": 1, "maximum": 10_000,
                                                   "default": 1000}}],
                        "responses": {"200": json_answer(ref("Profiles"), "profiles"),
                            "400": error("limit out of range")}}},
            **environment_paths(id_param, too_much_memory, environment_examples, max_fork),
            "/run_code": {"post": {
                "operationId": "runCode",
                "summary": "SandboxFusion's run_code: the code runs as one exec action in a sandbox of its own",
                "parameters": [{"name": "task", "in": "query", "required": False, "schema": TASK_NAME.json_schema(),
                                "description": "the task the call counts against (default: the token's, or "
                                               "sandbox-fusion)"},
                               {"name": "token", "in": "query", "required": False, "schema": {"type": "string"},
                                "description": "the bearer token, for callers that cannot send a header"}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref("RunCodeRequest")}}},
                "responses": {"200": json_answer(RUN_CODE_ANSWER, "SandboxFusion's answer: Success (exit 0), Failed "
                                                                  "(another exit, time or memory), SandboxError"),
                              "400": error("does not match the schema, or a bad task"),
                              "413": error("code or files too large"),
                              "422": error(f"{too_much_memory}, or no CPU manager"),
                              "429": over_cap("the task is at a cap (the body's cap names it)"),
                              "503": error("queue full, the broker is shutting down, or the call outlived its "
                                           "deadline")}}},
            "/v1/services": {"get": {
                "operationId": "listServices", "summary": "Reward services the GPU manager hosts, and where each is resident",
                "responses": {"200": json_answer({"type": "object", "required": ["services"], "properties": {
                    "services": {"type": "array", "items": ref("ServiceRecord")}}}, "services")}}},
            "/v1/services/{name}": {"get": {
                "operationId": "getService", "summary": "One reward service",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": json_answer(ref("ServiceRecord"), "the service"), "404": error("unknown service")}}},
            "/v1/resources": {"get": {"operationId": "getResources", "summary": "Capacity, use and queue per resource and pool",
                                      "responses": {"200": json_answer(ref("Resources"), "resources")}}},
            "/v1/status/history": {"get": {
                "operationId": "getStatusHistory", "summary": "The sampled time series the status page draws",
                "parameters": [{"name": "since", "in": "query", "required": False,
                                "schema": {"type": "number", "minimum": 0},
                                "description": "only samples taken after this time (seconds since the epoch)"}],
                "responses": {"200": json_answer(ref("StatusHistory"), "samples"), "400": error("bad since")}}},
            "/ui": {"get": {"operationId": "statusPage", "summary": "The status page (HTML; polls /v1/status/history and /v1/resources)",
                            "responses": {"200": {"description": "the page",
                                                  "content": {"text/html": {"schema": {"type": "string"}}}}}}},
            "/": {"get": {"operationId": "root", "summary": "Redirects to the status page",
                          "responses": {"302": {"description": "Location: /ui"}}}},
            "/healthz": {"get": {"operationId": "health", "summary": "Liveness", "responses": {"200": json_answer({"type": "object"}, "ok")}}},
            "/readyz": {"get": {"operationId": "ready", "summary": "Readiness: 503 while draining",
                                "responses": {"200": json_answer({"type": "object"}, "takes new work"),
                                              "503": json_answer({"type": "object"}, "draining: send new work elsewhere")}}},
            "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                      "responses": {"200": json_answer({"type": "object"}, "OpenAPI document")}}},
        },
        "components": {"schemas": schemas},
    }
    if secured:
        document["paths"].update(_admin_paths(server))
        _secure(document["paths"], public_status)
        document["components"]["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer", "description": "a task's or the admin's token (tangram token create)"}}
        document["security"] = [{"bearer": []}]
    _guarded(document["paths"], secured)
    return document
