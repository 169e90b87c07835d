"""The OpenAPI paths of trajectory environments (sandboxes): made, listed, read and destroyed, their files written
and read, forked; and the images their nodes pull ahead."""

from __future__ import annotations

from typing import Any

from tangram.server.openapi_parts import ENVIRONMENT_LINKS, error, json_answer, over_cap, ref, request_body


def environment_paths(id_param: dict[str, Any], too_much_memory: str, examples: dict[str, Any],
                      max_fork: int | None) -> dict[str, Any]:
    """``too_much_memory``: the 422's words on memory (``openapi._memory_bound``); ``examples``: the create
    request's; ``max_fork``: the most forks one request makes (None: no CPU manager)."""
    return {
        "/v1/environments": {
            "post": {"operationId": "createEnvironment", "summary": "Create a trajectory environment (sandbox) now",
                     "requestBody": {"required": True, "content": {"application/json": request_body(
                         ref("EnvironmentRequest"), examples)}},
                     "responses": {"201": json_answer(ref("EnvironmentRecord"), "created", ENVIRONMENT_LINKS),
                                   "400": error("invalid request"), "409": error("trajectory has one"),
                                   "413": error("files too large"),
                                   "422": error(f"unknown image, {too_much_memory}, no CPU manager"),
                                   "429": over_cap("too many environments: the task's max_environments "
                                                    "or max_memory_mb (named by cap), or cpu.max_environments; "
                                                    "or no node has the memory unreserved now"),
                                   "503": error("no node has the memory now, or the engine failed")}},
            "get": {"operationId": "listEnvironments", "summary": "List environments",
                    "parameters": [{"name": "task", "in": "query", "required": False,
                                    "schema": {"type": "string"}}],
                    "responses": {"200": json_answer({"type": "object", "required": ["environments"], "properties": {
                        "environments": {"type": "array", "items": ref("EnvironmentRecord")}}}, "environments"),
                        "422": error("no CPU manager")}}},
        "/v1/environments/{id}": {
            "get": {"operationId": "getEnvironment", "summary": "Get an environment", "parameters": [id_param],
                    "responses": {"200": json_answer(ref("EnvironmentRecord"), "the environment"),
                                  "404": error("unknown id"), "422": error("no CPU manager")}},
            "delete": {"operationId": "deleteEnvironment", "summary": "Destroy an environment",
                       "parameters": [id_param],
                       "responses": {"200": json_answer(ref("EnvironmentRecord"), "destroyed"),
                                     "404": error("unknown id"), "409": error("actions run in it"),
                                     "422": error("no CPU manager")}}},
        "/v1/environments/{id}/files": {
            "put": {"operationId": "writeEnvironmentFiles",
                    "summary": "Write files into an environment, after its running commands and before later ones",
                    "parameters": [id_param],
                    "requestBody": {"required": True, "content": {
                        "application/json": {"schema": ref("FilesRequest")},
                        "application/x-tar": {"schema": {"type": "string", "format": "binary"}}}},
                    "responses": {"200": json_answer({"type": "object", "required": ["environment", "files", "bytes"],
                                                "properties": {"environment": {"type": "string"},
                                                               "files": {"type": "integer"},
                                                               "bytes": {"type": "integer"}}}, "written"),
                                  "400": error("invalid request, or a body that is no uncompressed tar"),
                                  "404": error("unknown id, or a parent that is not there"),
                                  "409": error("the environment is lost"),
                                  "413": error("files past max_files or max_files_bytes, or body too large"),
                                  "422": error("a path that leaves the working directory (also through a link "
                                                "in the sandbox), a link, device or FIFO in a tar, a path that is "
                                                "a directory or special file, a write the sandbox's user may "
                                                "not make, no CPU manager"),
                                  "503": error("a command still runs there past max_wait_s, or the engine "
                                                "failed")}},
            "get": {"operationId": "readEnvironmentFile",
                    "summary": "Read a file (its bytes) or a directory (an uncompressed tar) of an environment",
                    "parameters": [id_param, {"name": "path", "in": "query", "required": True,
                                              "schema": {"type": "string"},
                                              "description": "relative to the working directory; . for all"}],
                    "responses": {"200": {"description": "the file's bytes, or a tar of the directory",
                                          "content": {"application/octet-stream": {"schema": {
                                              "type": "string", "format": "binary"}},
                                                      "application/x-tar": {"schema": {
                                                          "type": "string", "format": "binary"}}}},
                                  "400": error("path missing"), "404": error("unknown id or path"),
                                  "409": error("the environment is lost"),
                                  "413": error("the file or the directory's tar is past max_files_bytes"),
                                  "422": error("a path that leaves the working directory (also through a link "
                                                "in the sandbox), a FIFO, socket or device, no CPU manager"),
                                  "503": error("a command still runs there past max_wait_s, or the engine "
                                                "failed")}}},
        "/v1/environments/{id}/fork": {
            "post": {"operationId": "forkEnvironment",
                     "summary": "Make n environments from one's files, once its running commands end, each its "
                                "own trajectory (Docker sandboxes)",
                     "parameters": [id_param, {"name": "n", "in": "query", "required": False,
                                               "schema": {"type": "integer", "minimum": 1,
                                                          **({} if max_fork is None else {"maximum": max_fork})},
                                               "description": "how many, at most [cpu.limits] max_fork; left "
                                                              "out: as many as the body's trajectories"}],
                     "requestBody": {"required": False, "content": {"application/json": {
                         "schema": ref("ForkRequest")}}},
                     "responses": {"201": json_answer({"type": "object", "required": ["source", "environments"],
                                                 "properties": {"source": {"type": "string"},
                                                                "environments": {"type": "array", "items": ref(
                                                                    "EnvironmentRecord")}}}, "the forks"),
                                   "400": error("n out of range"),
                                   "404": error("unknown id"),
                                   "409": error("a trajectory has an environment, or the source is lost"),
                                   "422": error("neither n nor trajectories, trajectories not one per "
                                                 "fork, a sandbox that cannot be "
                                                 "forked (local processes, a node agent, read_only_root), no "
                                                 "CPU manager"),
                                   "429": over_cap("the task's max_environments or max_memory_mb (named by "
                                                    "cap), cpu.max_environments, or the source's node has not "
                                                    "the memory for the forks now"),
                                   "503": error("a command still runs there past max_wait_s, or the engine "
                                                 "failed")}}},
        "/v1/images/pull": {
            "post": {"operationId": "prePullImages",
                     "summary": "Have every CPU node start pulling the images it lacks of a task's list, in the "
                                "background",
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": ref("PrePullRequest")}}},
                     "responses": {"202": json_answer({"type": "object", "required": ["task", "images", "nodes"],
                                                 "properties": {
                                                     "task": {"type": "string"},
                                                     "images": {"type": "array", "items": {"type": "string"}},
                                                     "nodes": {"type": "object", "additionalProperties": {
                                                         "enum": ["pulling", "not_pulling"]}}}},
                                                "the nodes asked, and whether each pulls"),
                                   "400": error("invalid request"), "422": error("no CPU manager")}}},
    }
