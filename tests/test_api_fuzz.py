"""API fuzzing (issue 7): schemathesis builds requests from the broker's own ``/openapi.json`` and checks every answer.

No request may get a 5xx; every answer must have a documented status, content type, headers and body schema; a
request the document calls invalid must be rejected with a 4xx; and the stateful run follows the document's links
(submit -> get -> cancel / release, create environment -> get -> delete). The broker is real (SQLite, the Basic
manager with a lease and an API resource, the CPU manager on local processes, the GPU manager on virtual CPU GPUs)
and serves on loopback from a thread with its own event loop, because schemathesis' calls block. The seed is fixed
and generation derandomized, so a CI failure reproduces locally. Regression tests for what the fuzzer found follow.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from pydantic import BaseModel

from managers.basic.manager import LeaseSpec
from managers.basic.upstream import ApiSpec
from managers.cpu.exec_spec import ExecSpecBody
from reward_services.requests import RewardSpecBody
from tangram.config import ServerConfig
from tangram.parse import Limits
from tangram.server.openapi import openapi_document
from tests.docker_nodes import new_broker_id
from tests.harness import Live, live_broker

pytestmark = pytest.mark.slow  # schemathesis walks every operation

#: fixed, so a CI failure reproduces; another (TANGRAM_FUZZ_SEED) for a held-out run
SEED = int(os.environ.get("TANGRAM_FUZZ_SEED", "7"))
EXAMPLES_PER_OPERATION = int(os.environ.get("TANGRAM_FUZZ_EXAMPLES", "25"))
STATEFUL_SCENARIOS = int(os.environ.get("TANGRAM_FUZZ_SCENARIOS", "30"))
#: the broker's answers to a request it refuses; 413 and 422 are documented rejections (too large, never runnable)
REJECTIONS = ["400", "404", "405", "409", "413", "422"]
#: short waits; small batches (a negative batch of max_batch + 1 items stays small); a status history with samples
SERVER: dict[str, Any] = {"max_wait_s": 1.0, "max_batch": 20, "status_interval_s": 0.5}
#: the resources of ``broker_config``, which the document lists as the only demandable ones
RESOURCES = ("api.search", "cpu", "gpu", "lease.local")
#: the CPU node's memory, which the document states as the most a sandbox may reserve
NODE_MEMORY_MB = 1 << 20
#: forks per request: few, so that a fork's answer does not depend on the room earlier examples left on the node
MAX_FORK = 2


def broker_config(run_dir: str) -> dict[str, Any]:
    """Every route has something to serve; nothing can block for long (waits of at most 1 s, leases of 2 s); room
    for more sandboxes than a run makes, so an answer does not depend on what earlier examples left behind."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    return {
        "server": SERVER,
        "basic": {"lease.local": {"concurrency": 4, "lease_ttl_s": 2.0},
                  # nothing listens on the discard port: api actions fail cleanly (upstream unreachable)
                  "api.search": {"concurrency": 2, "upstream": {"base_url": "http://127.0.0.1:9", "timeout_s": 1.0,
                                                           "max_retries": 0}}},
        "cpu": {"broker_id": new_broker_id(), "run_dir": run_dir, "default_memory_mb": 64, "idle_ttl_s": 30.0,
                "limits": {"max_fork": MAX_FORK},
                "nodes": {"here": {"backend": "local", "unsandboxed": True, "cores": cores,
                                   "memory_mb": NODE_MEMORY_MB}}},
        "gpu": {"enabled": True, "nodes": {"v": {"gpus": 2, "gpu_memory_mb": 1000, "host_memory_mb": 1000,
                                                 "device_type": "cpu"}}},
    }


#: the document this broker serves (checked below), loaded when the module is collected: schemathesis makes one
#: test per operation from it. Its lazy from_fixture loader does not run under pytest 9.2 (it sets Node._nodeid).
#: the spec type of each kind, as the config's managers declare them
SPECS: dict[str, type[BaseModel]] = {"exec": ExecSpecBody, "reward": RewardSpecBody, "api": ApiSpec, "lease": LeaseSpec}
DOCUMENT = openapi_document(ServerConfig(**SERVER), Limits(), RESOURCES, SPECS, max_memory_mb=NODE_MEMORY_MB,
                            max_fork=MAX_FORK)
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT, config=schemathesis.Config.from_dict({
    "seed": SEED,
    "generation": {"max-examples": EXAMPLES_PER_OPERATION, "deterministic": True, "database": "none"},
    "checks": {
        # a request the document's schemas accept is never a 400: what they cannot say (min <= max, the elasticity
        # resource in the demand, units the pools have, a service's input for its task) is a 422; ids that name
        # nothing are 404s, objects in the wrong state 409s, capacity that clears with time 429s; GET / redirects
        # (302) to the status page
        "positive_data_acceptance": {"expected-statuses": ["2XX", "302", "404", "409", "422", "429"]},
        "negative_data_rejection": {"expected-statuses": REJECTIONS},
        # DELETE /v1/actions/{id} cancels: the record stays readable (state cancelled), as a record should
        "use_after_free": {"enabled": False},
    },
}))


@contextmanager
def broker_in_thread(raw: dict[str, Any], db_path: str) -> Iterator[str]:
    """A live broker on an event loop of its own thread; yields its URL. Errors at start or stop propagate."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzzed-broker", daemon=True)
    thread.start()
    broker = live_broker(raw, db_path)
    try:
        live = asyncio.run_coroutine_threadsafe(broker.__aenter__(), loop).result(timeout=120)
        try:
            yield live.url
        finally:
            asyncio.run_coroutine_threadsafe(broker.__aexit__(None, None, None), loop).result(timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()


@contextmanager
def fuzzed_broker(db_dir: Path) -> Iterator[str]:
    run_dir = tempfile.mkdtemp(prefix="tf-")  # short: executor socket paths must fit in 107 bytes
    try:
        with broker_in_thread(broker_config(run_dir), str(db_dir / "tangram.db")) as url:
            yield url
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fuzzed_broker(tmp_path_factory.mktemp("fuzz")) as url:
        yield url


def test_the_fuzzed_document_is_the_one_the_broker_serves(broker_url: str) -> None:
    """The operations' tests come from ``DOCUMENT``, built in this process: it must be what /openapi.json says."""
    with urllib.request.urlopen(f"{broker_url}/openapi.json", timeout=30) as response:
        assert json.load(response) == json.loads(json.dumps(DOCUMENT))


@SCHEMA.parametrize()
def test_every_operation_answers_as_documented(case: schemathesis.Case, broker_url: str) -> None:
    """Examples, coverage cases (boundaries, undeclared methods) and fuzzed requests, valid and invalid."""
    case.call_and_validate(base_url=broker_url, timeout=30)


def test_stateful_workflows_follow_the_documents_links(tmp_path: Path) -> None:
    """Chains along the links: a record's id from a submit is fetched, waited on, cancelled or released; a created
    environment is fetched and deleted. Hypothesis replays scenarios and needs the same answers again, so the run
    has a broker of its own and every scenario works in a task of its own (see ``in_task_of_scenario``)."""
    with fuzzed_broker(tmp_path) as broker_url:

        class Workflow(SCHEMA.as_state_machine()):  # type: ignore[misc]
            scenarios = itertools.count()

            def setup(self) -> None:
                self.suffix = f"-s{next(self.scenarios)}"
                self.actions: list[str] = []

            def before_call(self, case: schemathesis.Case) -> None:
                in_task_of_scenario(case, self.suffix)

            def after_call(self, response: schemathesis.Response, case: schemathesis.Case) -> None:
                if case.operation.path in ("/v1/actions", "/v1/actions:batch") and response.status_code < 300:
                    body = response.json()
                    self.actions += [record["id"] for record in body.get("actions", [body])]

            def teardown(self) -> None:
                end_scenario(broker_url, self.suffix, self.actions)

            def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
                return {"base_url": broker_url, "timeout": 30}

        Workflow.run(settings=hypothesis.settings(max_examples=STATEFUL_SCENARIOS, stateful_step_count=6,
                                                  derandomize=True, database=None, deadline=None,
                                                  suppress_health_check=list(hypothesis.HealthCheck)))


def end_scenario(url: str, suffix: str, actions: list[str]) -> None:
    """Cancel a scenario's actions and delete its sandboxes: they reserve the node's memory (up to all of it, the
    document's maximum), and a later scenario that found it reserved would get other answers (429) than on the
    replay Hypothesis compares it with."""
    for action in actions:
        http(url + f"/v1/actions/{action}", "DELETE")  # 409 for one that ended: nothing to do
    deadline = time.monotonic() + 30
    while left := [env["id"] for env in http(url + "/v1/environments", "GET")[1]["environments"]
                   if env["task"].endswith(suffix)]:
        assert time.monotonic() < deadline, f"environments of scenario {suffix} not deleted: {left}"
        for env in left:
            http(url + f"/v1/environments/{env}", "DELETE")  # 409 while a cancelled command is still stopping
        time.sleep(0.1)


def http(url: str, method: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def in_task_of_scenario(case: schemathesis.Case, suffix: str) -> None:
    """Append the scenario's suffix to every task the request names. What an earlier scenario made under the same
    task (a trajectory's sandbox: 409; an idempotency key: a replay) then cannot change this one's answers. A
    suffix keeps an invalid task invalid (a name must start alphanumeric and may not grow past 128 characters).
    Copies first: a body may be the document's own example object, which later cases reuse."""
    case.body, case.query = copy.deepcopy(case.body), copy.deepcopy(case.query)
    bodies = case.body.get("actions") if case.operation.path == "/v1/actions:batch" and isinstance(
        case.body, dict) else [case.body]
    for body in bodies if isinstance(bodies, list) else []:
        if isinstance(body, dict) and isinstance(task := body.get("task"), str):
            body["task"] = task + suffix
    if isinstance(case.query, dict) and isinstance(case.query.get("task"), str):
        case.query["task"] += suffix


# ------------------------------------------- what the fuzzer found ----------------------------------------------


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    run_dir = tempfile.mkdtemp(prefix="tf-")
    try:
        async with live_broker(broker_config(run_dir), str(tmp_path / "tangram.db")) as broker:
            yield broker
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def lease(**fields: Any) -> dict[str, Any]:
    return {"task": "t", "kind": "lease", "demand": {"lease.local": 1}, "spec": {"ttl_s": 1}, **fields}


@pytest.mark.parametrize("resource", [{}, [], 1, None])
async def test_an_elasticity_resource_that_is_no_name_is_a_400_not_a_500(live: Live, resource: Any) -> None:
    """Found as a 500: a dict or list as elasticity.resource reached `in demands` and raised TypeError."""
    code, reply = await live.call("POST", "/v1/actions", json=lease(
        elasticity={"resource": resource, "efficiency": {"1": 1.0}}))
    assert (code, reply["error"]["field"]) == (400, "elasticity.resource"), reply


@pytest.mark.parametrize("field", ["task", "trajectory"])
async def test_a_trailing_newline_does_not_pass_for_a_name(live: Live, field: str) -> None:
    """Python's `$` matches before a final newline: "t\\n" was a valid task, unlike in the document's pattern."""
    named = {"task": "t", field: "name\n"}
    code, reply = await live.call("POST", "/v1/actions", json=lease(**named))
    assert (code, reply["error"]["field"]) == (400, field), reply
    code, reply = await live.call("POST", "/v1/environments", json=named)
    assert (code, reply["error"]["field"]) == (400, field), reply


@pytest.mark.parametrize("count", ["01", " 1", "+1", "1_0", "\u0661"])
async def test_an_efficiency_key_is_plain_digits(live: Live, count: str) -> None:
    """int() takes all of these (the last is an Arabic-Indic one); "01" and "1" would be the same point twice."""
    code, reply = await live.call("POST", "/v1/actions", json=lease(
        demand={"lease.local": {"min": 1, "max": 2}}, elasticity={"resource": "lease.local",
                                                                  "efficiency": {count: 1.0}}))
    assert (code, reply["error"]["field"]) == (400, f"elasticity.efficiency.{count}"), reply


async def test_null_is_the_same_as_leaving_a_field_out(live: Live) -> None:
    """Found as schema-violating requests accepted: trajectory: null passed but spec: null was a 400, and
    environments took memory_mb: null but not files: null. Now null means absent everywhere, as documented."""
    nulls = dict.fromkeys(("trajectory", "elasticity", "spec", "timeout_s", "idempotency_key", "signature"))
    code, record = await live.call("POST", "/v1/actions?wait=true", json=lease(**nulls))
    assert code == 200 and record["state"] == "succeeded", record
    assert (record["spec"], record["timeout_s"], record["trajectory"]) == ({}, 600.0, None)
    code, record = await live.call("POST", "/v1/actions", json=lease(elasticity={
        "resource": "lease.local", "efficiency": {"1": 1.0}, "t1": None}))
    assert code == 201 and record["elasticity"] == {"resource": "lease.local", "efficiency": {"1": 1.0}}, record
    code, record = await live.call("POST", "/v1/actions", json=lease(elasticity={  # nothing declared: learned
        "resource": "lease.local", "efficiency": None, "t1": None}))
    assert code == 201 and record["elasticity"] == {"resource": "lease.local"}, record
    code, env = await live.call("POST", "/v1/environments", json=dict.fromkeys(
        ("trajectory", "image", "memory_mb", "files"), None) | {"task": "t"})
    assert code == 201 and env["state"] == "ready" and env["memory_mb"] == 64, env
    code, _ = await live.call("DELETE", f"/v1/environments/{env['id']}")
    assert code == 200


async def test_a_bad_wait_timeout_is_a_400_even_without_wait(live: Live) -> None:
    """Found as a schema-violating query accepted: wait_timeout_s was read only with wait=true."""
    code, reply = await live.call("POST", "/v1/actions?wait_timeout_s=soon", json=lease())
    assert (code, reply["error"]["field"]) == (400, "wait_timeout_s"), reply
    assert not live.broker.actions  # nothing was queued
    code, reply = await live.call("GET", "/v1/actions/act_nope?wait_timeout_s=-1")
    assert (code, reply["error"]["field"]) == (400, "wait_timeout_s"), reply


async def test_a_405_names_the_allowed_methods(live: Live) -> None:
    """Found by the undeclared-method check: the JSON error body replaced aiohttp's answer and lost its Allow."""
    async with live.http.request("TRACE", f"{live.url}/v1/environments") as response:
        assert response.status == 405
        assert {method.strip() for method in response.headers["Allow"].split(",")} >= {"GET", "POST"}
        assert (await response.json())["error"]["field"] == "path"
