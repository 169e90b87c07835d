"""Locust load test of an ARL-Tangram broker with the action mix of agentic RL rollouts.

Each simulated user is a rollout worker running trajectories back to back. A trajectory alternates think time
(LLM generation: lognormal with a median of 1 s, times ``LOADTEST_THINK_SCALE``) with one action, as agents do:

* ``CodingTrajectory``: short shell calls in the trajectory's own sandbox (the first one creates it with a small
  repository holding a bug), the last of which fixes the bug; then an elastic test run (``pytest`` rewritten to
  ``pytest -n N`` on 1..``LOADTEST_TEST_CPUS`` cores), a reward step scoring the fix against a reference, and the
  ``DELETE`` of its environment.
* ``SearchTrajectory``: search and fetch calls proxied by the broker to its ``api.search`` upstream, then a reward
  step scoring the answer against a reference.
* ``LeaseTrajectory``: takes lease units, holds them for a think time, gives them back.

Requests are named ``"<kind> <step>"`` (``exec shell``, ``exec tests``, ``api search``, ``reward``, ...), so the
stats split per kind. A request counts as a failure unless the action ended ``succeeded`` *and* its result is what
the step needed (exit code 0, the upstream's 200, one score per pair): zero failures means the broker did the work,
not only that HTTP said 200. Think times use ``gevent.sleep``, so with ``--stop-timeout`` a user stopped by
``--run-time`` finishes its trajectory and deletes its sandbox.

Settings (environment variables; loadtest/README.md has the headless command):

``LOADTEST_MIX``               user weights, ``coding=3,search=2,lease=1``; 0 leaves a kind out
``LOADTEST_THINK_SCALE``       multiplies every think time (1.0; 0.1 for short runs)
``LOADTEST_SHELL_STEPS``       shell calls per coding trajectory before its test run (4)
``LOADTEST_SEARCH_STEPS``      api calls per search trajectory (3)
``LOADTEST_TEST_CPUS``         most cores the elastic test run may get (2)
``LOADTEST_SANDBOX_MEMORY_MB`` memory each coding sandbox reserves (512)
``LOADTEST_LEASE_UNITS``       units per lease (1)
``LOADTEST_TIMEOUT_S``         deadline of every action, queueing included (120); requests wait 30 s longer
``LOADTEST_TASK``              the RL task the actions belong to (``locust``)
``LOADTEST_TOKEN``             bearer token sent with every request, for a broker with auth (none)
``LOADTEST_API_RESOURCE``, ``LOADTEST_LEASE_RESOURCE``, ``LOADTEST_REWARD_SERVICE``
                               what the broker calls them (``api.search``, ``lease.local``, ``minilm-judge``)
"""

from __future__ import annotations

import json
import logging
import os
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gevent
from locust import FastHttpUser, constant, task
from locust.contrib.fasthttp import ResponseContextManager

Check = Callable[[Any], str | None]  # the action's result -> what is wrong with it, or None
log = logging.getLogger("loadtest")


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: must be an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: must be at least {minimum}")
    return value


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: must be a number") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"{name}={raw!r}: must be a finite number >= 0")
    return value


def _mix(raw: str) -> dict[str, int]:
    """``coding=3,search=2,lease=1`` -> weights; kinds left out weigh 0."""
    weights = dict.fromkeys(("coding", "search", "lease"), 0)
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, _, weight = item.partition("=")
        if name.strip() not in weights or not weight.strip().isdigit():
            raise ValueError(f"LOADTEST_MIX={raw!r}: items are NAME=WEIGHT with NAME in {sorted(weights)} and "
                             f"WEIGHT a whole number")
        weights[name.strip()] = int(weight)
    if not any(weights.values()):
        raise ValueError(f"LOADTEST_MIX={raw!r}: at least one weight must be positive")
    return weights


@dataclass(frozen=True)
class Settings:
    mix: dict[str, int]
    think_scale: float
    shell_steps: int
    search_steps: int
    test_cpus: int
    sandbox_memory_mb: int
    lease_units: int
    timeout_s: float
    task: str
    token: str | None
    api_resource: str
    lease_resource: str
    reward_service: str

    @classmethod
    def from_environment(cls) -> Settings:
        timeout = _env_float("LOADTEST_TIMEOUT_S", 120.0)
        if timeout <= 0:
            raise ValueError("LOADTEST_TIMEOUT_S must be positive")
        return cls(mix=_mix(os.environ.get("LOADTEST_MIX", "coding=3,search=2,lease=1")),
                   think_scale=_env_float("LOADTEST_THINK_SCALE", 1.0),
                   shell_steps=_env_int("LOADTEST_SHELL_STEPS", 4, 1),
                   search_steps=_env_int("LOADTEST_SEARCH_STEPS", 3, 1),
                   test_cpus=_env_int("LOADTEST_TEST_CPUS", 2, 1),
                   sandbox_memory_mb=_env_int("LOADTEST_SANDBOX_MEMORY_MB", 512, 1),
                   lease_units=_env_int("LOADTEST_LEASE_UNITS", 1, 1),
                   timeout_s=timeout,
                   task=os.environ.get("LOADTEST_TASK", "locust"),
                   token=os.environ.get("LOADTEST_TOKEN") or None,
                   api_resource=os.environ.get("LOADTEST_API_RESOURCE", "api.search"),
                   lease_resource=os.environ.get("LOADTEST_LEASE_RESOURCE", "lease.local"),
                   reward_service=os.environ.get("LOADTEST_REWARD_SERVICE", "minilm-judge"))


SETTINGS = Settings.from_environment()

# The coding task: a repository whose `mean` is wrong; the trajectory's last shell call fixes it.
REPOSITORY = {
    "repo/calc.py": "def add(a, b):\n    return a + b\n\n\n"
                    "def mean(values):\n    return sum(values) / (len(values) - 1)\n",
    "repo/tests/test_calc.py": "from calc import add, mean\n\n\n"
                               "def test_add():\n    assert add(2, 3) == 5\n\n\n"
                               "def test_add_negative():\n    assert add(-2, 2) == 0\n\n\n"
                               "def test_mean():\n    assert mean([1, 2, 3]) == 2\n\n\n"
                               "def test_mean_single():\n    assert mean([4]) == 4\n",
    "repo/conftest.py": "",  # puts repo/ on sys.path for the tests
}
EXPLORE = ("ls -R repo && cat repo/calc.py", "grep -n 'def ' repo/calc.py",
           "cd repo && python3 -c 'import calc; print(calc.add(2, 3))'", "wc -l repo/calc.py repo/tests/*.py")
FIX = "sed -i 's/(len(values) - 1)/len(values)/' repo/calc.py && cat repo/calc.py"
REFERENCE_FIX = "def mean(values):\n    return sum(values) / len(values)\n"
QUESTIONS = (("How do I run pytest tests in parallel?", "Install pytest-xdist and run pytest -n with a worker count."),
             ("What limits a container's CPUs?", "The cgroup cpuset and CPU quota of the container."),
             ("How are sentence embeddings compared?", "By the cosine similarity of the two embedding vectors."),
             ("Why use asyncio for a broker?", "One event loop serves many concurrent requests cheaply."))
TEST_ELASTICITY = {"resource": "cpu", "t1": 2.0, "efficiency": {"1": 1.0, "2": 0.9, "4": 0.8, "8": 0.7}}
REWARD_ELASTICITY = {"resource": "gpu", "t1": 0.2, "efficiency": {"1": 1.0, "2": 0.6}}


def think() -> None:
    """One LLM generation's worth of waiting; gevent.sleep, not User.wait, so a stopping user ends its trajectory."""
    gevent.sleep(SETTINGS.think_scale * random.lognormvariate(0.0, 0.5))


def _problem(response: ResponseContextManager, check: Check) -> tuple[str | None, dict[str, Any] | None]:
    """What went wrong with an action request (None if nothing), and the action's record when there is one."""
    if response.status_code != 200:  # 202 too: the broker must end every action by its deadline
        detail = (response.text or "")[:300] if response.status_code else getattr(response, "error", None)
        return f"HTTP {response.status_code}: {detail}", None
    try:
        record = response.json()
    except ValueError:
        return "the broker's reply is not JSON", None
    if record.get("state") != "succeeded":
        error = record.get("error") or {}
        return f"action ended {record.get('state')}: {error.get('code')}", record
    return check(record.get("result")), record


@dataclass(frozen=True)
class Step:
    ok: bool
    record: dict[str, Any] | None


class Trajectory(FastHttpUser):
    """A rollout worker: the action helper its trajectories share."""

    abstract = True
    wait_time = constant(0)  # one trajectory follows another; the think times are inside them
    network_timeout = SETTINGS.timeout_s + 60.0
    default_headers = {"Authorization": f"Bearer {SETTINGS.token}"} if SETTINGS.token else None

    def act(self, kind: str, step: str, demand: dict[str, Any], spec: dict[str, Any],
            check: Check = lambda result: None, **fields: Any) -> Step:
        body = {"task": SETTINGS.task, "kind": kind, "demand": demand, "spec": spec,
                "timeout_s": SETTINGS.timeout_s, **fields}
        name = f"{kind} {step}".strip()
        url = f"/v1/actions?wait=true&wait_timeout_s={SETTINGS.timeout_s + 30:g}"
        with self.client.post(url, json=body, name=name, catch_response=True) as response:
            problem, record = _problem(response, check)
            if problem is None:
                response.success()
            else:
                response.failure(problem)
                log.warning("%s failed: %s (action %s)", name, problem, (record or {}).get("id"))
        return Step(problem is None, record)

    def delete(self, path: str, name: str) -> None:
        with self.client.delete(path, name=name, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:300]}")

    def reward(self, response_text: str, reference: str) -> Step:
        def check(result: Any) -> str | None:
            scores = result.get("scores") if isinstance(result, dict) else None
            if not (isinstance(scores, list) and len(scores) == 1 and isinstance(scores[0], float)
                    and -1.0001 <= scores[0] <= 1.0001):
                return f"expected one cosine score, got {json.dumps(result)[:200]}"
            return None

        return self.act("reward", "", {"gpu": {"choices": [1, 2]}},
                        {"service": SETTINGS.reward_service, "input": {"pairs": [[response_text, reference]]}},
                        check, elasticity=REWARD_ELASTICITY)


def _exit_zero(result: Any) -> str | None:
    result = result if isinstance(result, dict) else {}
    if result.get("exit_code") == 0:
        return None
    return f"command exited {result.get('exit_code', result.get('signal'))}: {str(result.get('stderr'))[-200:]}"


def _tests_passed(result: Any) -> str | None:
    problem = _exit_zero(result)
    if problem is None and " passed" not in str(result.get("stdout")):
        return "pytest reported no passed tests"
    return problem


def _environment_of(record: dict[str, Any] | None) -> str | None:
    for part in ("result", "error"):
        value = (record or {}).get(part)
        if isinstance(value, dict) and isinstance(value.get("environment"), str):
            return value["environment"]
    return None


class CodingTrajectory(Trajectory):
    """A software-engineering rollout: explore, fix, test, score, clean up."""

    weight = SETTINGS.mix["coding"]
    abstract = weight == 0

    @task
    def trajectory(self) -> None:
        trajectory = f"coding-{uuid.uuid4().hex[:12]}"
        commands = [EXPLORE[i % len(EXPLORE)] for i in range(SETTINGS.shell_steps - 1)] + [FIX]
        environment: str | None = None
        try:
            fixed = ""
            for i, command in enumerate(commands):
                think()
                spec: dict[str, Any] = {"command": command}
                if i == 0:
                    spec.update(files=REPOSITORY, memory_mb=SETTINGS.sandbox_memory_mb)
                step = self.act("exec", "shell", {"cpu": 1}, spec, _exit_zero, trajectory=trajectory)
                environment = environment or _environment_of(step.record)
                if not step.ok:
                    return
                fixed = step.record["result"]["stdout"] if step.record else ""
            think()
            cpus = {"min": 1, "max": SETTINGS.test_cpus} if SETTINGS.test_cpus > 1 else 1
            step = self.act("exec", "tests", {"cpu": cpus},
                            {"command": "cd repo && pytest -q -p no:cacheprovider tests", "pytest_parallel": True},
                            _tests_passed, trajectory=trajectory, elasticity=TEST_ELASTICITY)
            if step.ok:
                self.reward(fixed, REFERENCE_FIX)
        finally:
            environment = environment or self._find_environment(trajectory)
            if environment is not None:
                self.delete(f"/v1/environments/{environment}", "DELETE environment")

    def _find_environment(self, trajectory: str) -> str | None:
        """The sandbox of a trajectory whose records did not name it (an action that failed before running)."""
        response = self.client.get(f"/v1/environments?task={SETTINGS.task}", name="environment list")
        if response.status_code != 200:
            return None
        return next((env["id"] for env in response.json()["environments"] if env["trajectory"] == trajectory), None)


def _upstream_ok(field: str) -> Check:
    def check(result: Any) -> str | None:
        if not isinstance(result, dict) or result.get("status") != 200:
            return f"upstream answered {result.get('status') if isinstance(result, dict) else result}"
        if not isinstance(result.get("body"), dict) or not result["body"].get(field):
            return f"upstream body has no {field!r}"
        return None

    return check


class SearchTrajectory(Trajectory):
    """A search-agent rollout: search, read, answer, score."""

    weight = SETTINGS.mix["search"]
    abstract = weight == 0

    @task
    def trajectory(self) -> None:
        question, reference = random.choice(QUESTIONS)
        demand = {SETTINGS.api_resource: 1}
        answer = ""
        url = ""
        for i in range(SETTINGS.search_steps):
            think()
            if i % 2 == 1 and url:
                step = self.act("api", "fetch", demand, {"method": "GET", "path": "/fetch", "query": {"url": url}},
                                _upstream_ok("text"))
            else:
                query = question if i == 0 else f"{question} example {i}"
                step = self.act("api", "search", demand,
                                {"method": "GET", "path": "/search", "query": {"q": query, "k": 5}},
                                _upstream_ok("results"))
                if step.ok and step.record:
                    top = step.record["result"]["body"]["results"][0]
                    url, answer = top["url"], top["snippet"]
            if not step.ok:
                return
        think()
        self.reward(answer, reference)


class LeaseTrajectory(Trajectory):
    """A rollout holding quota units (e.g. for an external model) while it generates, then handing them back."""

    weight = SETTINGS.mix["lease"]
    abstract = weight == 0

    @task
    def trajectory(self) -> None:
        think()
        step = self.act("lease", "", {SETTINGS.lease_resource: SETTINGS.lease_units},
                        {"ttl_s": max(60.0, 10 * SETTINGS.think_scale)})
        if step.ok and step.record:
            think()
            self.delete(f"/v1/leases/{step.record['id']}", "DELETE lease")
