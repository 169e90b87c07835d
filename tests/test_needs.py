"""The fast lane's markers (``tests/needs.py``): read from what a test's code reaches, through helpers of ``tests``.

The analysis sees names, not whether they run: this file is itself marked ``docker`` and ``ray``."""

from __future__ import annotations

import docker

from tests.docker_nodes import docker_engines
from tests.needs import reached_needs
from tests.ray_clusters import two_node_cluster


def engines_through_a_helper() -> list[str]:
    return docker_engines()


def calls_the_helper() -> int:
    return len(engines_through_a_helper())


def uses_the_sdk() -> object:
    return docker.from_env


def starts_ray() -> object:
    return two_node_cluster


def needs_nothing() -> int:
    return sum(range(3))


def test_a_need_is_found_through_helpers_and_the_sdk_and_not_where_there_is_none() -> None:
    assert reached_needs([calls_the_helper]) == {"docker"}
    assert reached_needs([uses_the_sdk]) == {"docker"}
    assert reached_needs([starts_ray]) == {"ray"}
    assert reached_needs([needs_nothing]) == set()
    assert reached_needs([needs_nothing, starts_ray, calls_the_helper]) == {"docker", "ray"}

