"""The building blocks of the OpenAPI document's operations (``openapi.py`` and the path modules beside it)."""

from __future__ import annotations

from typing import Any

ENVIRONMENT_LINKS = {name: {"operationId": operation, "parameters": {"id": "$response.body#/id"}}
                     for name, operation in (("GetEnvironment", "getEnvironment"),
                                             ("DeleteEnvironment", "deleteEnvironment"))}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_answer(schema: dict[str, Any], description: str, links: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": schema}}}
    if links:
        response["links"] = links
    return response


def request_body(schema: dict[str, Any], examples: dict[str, Any]) -> dict[str, Any]:
    return {"schema": schema, "examples": examples} if examples else {"schema": schema}


def error(description: str) -> dict[str, Any]:
    return json_answer(ref("Error"), description)


def over_cap(description: str) -> dict[str, Any]:
    """A 429: the body names the cap; ``Retry-After`` says when to try again."""
    response = error(description)
    response["headers"] = {"Retry-After": {"description": "seconds to wait before trying again",
                                           "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return response
