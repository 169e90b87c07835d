"""What a test needs from the machine (Docker, Ray, a browser, PostgreSQL), read from its code, so that markers
follow the code instead of being kept by hand: the fast lane (``-m "not (docker or ray or browser or postgres)"``)
then leaves out exactly the tests that start one of them.

A test needs what its function, the fixtures it uses and the helpers of ``tests`` they call refer to: Docker through
the engines of ``tests/docker_nodes.py`` or the Docker SDK, Ray through the ``ray`` package or
``tests/ray_clusters.py``, a browser through Selenium, PostgreSQL through the PostgreSQL fixtures or the names of
``conftest`` that reach it (the store fixture's ``postgres`` case is marked where it is parametrised).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest

#: the helpers of ``tests`` that reach a test engine (by module and name: importing them here would import Ray
#: before ``conftest`` keeps it on loopback)
DOCKER_HELPERS = frozenset({("tests.docker_nodes", "docker_engines"), ("tests.docker_nodes", "userns_engine"),
                            ("tests.docker_nodes", "labelled_containers")})
RAY_HELPERS_MODULE = "tests.ray_clusters"
POSTGRES_FIXTURES = frozenset({"postgres_url"})
#: the names of ``conftest`` a test that reaches PostgreSQL without those fixtures uses (``conftest``'s own
#: fixtures use them too, and are judged by where they are parametrised)
POSTGRES_NAMES = frozenset({"PG_URL_ENV", "reset_database", "empty_postgres"})
#: the markers set here
NEEDS = ("docker", "ray", "browser", "postgres")


def _package(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return value.__name__
    return getattr(value, "__module__", None) or ""


def _needs_of(value: Any) -> set[str]:
    package = _package(value)
    needs = set()
    if (package, getattr(value, "__name__", "")) in DOCKER_HELPERS or package.split(".")[0] == "docker":
        needs.add("docker")
    if package == RAY_HELPERS_MODULE or package.split(".")[0] == "ray":
        needs.add("ray")
    if package.startswith("selenium"):
        needs.add("browser")
    return needs


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def reached_needs(functions: Iterable[Callable[..., Any]]) -> set[str]:
    """The needs of ``functions``, following the global names they use into other functions of ``tests``."""
    needs: set[str] = set()
    seen: set[int] = set()
    stack = [inspect.unwrap(f) for f in functions]
    while stack:
        function = stack.pop()
        if id(function) in seen or not hasattr(function, "__code__"):
            continue
        seen.add(id(function))
        namespace = function.__globals__
        for code in _codes(function.__code__):
            for name in code.co_names:
                if name in POSTGRES_NAMES and not function.__module__.endswith("conftest"):
                    needs.add("postgres")
                value = namespace.get(name)
                if value is None:
                    continue
                needs |= _needs_of(value)
                if inspect.isfunction(value) and value.__module__.startswith("tests"):
                    stack.append(value)
    return needs


def _requested_fixtures(item: pytest.Item) -> list[Callable[..., Any]]:
    """The functions of the fixtures the test asks for and of those they ask for in turn (not the autouse ones,
    which every test gets: the suite's end-of-session sandbox check would otherwise mark every test)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    functions = []
    names = list(info.argnames)
    seen: set[str] = set()
    while names:
        name = names.pop()
        definitions = info.name2fixturedefs.get(name)
        if name in seen or not definitions:
            continue
        seen.add(name)
        functions.append(definitions[-1].func)
        names.extend(definitions[-1].argnames)
    return functions


def mark(items: list[pytest.Item]) -> None:
    """Add the markers of what each test needs (a marker already set, by parametrisation, stays)."""
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        needs = reached_needs([function, *_requested_fixtures(item)])
        if POSTGRES_FIXTURES & set(getattr(item, "fixturenames", ())):
            needs.add("postgres")
        for need in sorted(needs):
            item.add_marker(need)

