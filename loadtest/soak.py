"""Soak test of an ARL-Tangram broker: thousands of mixed actions under random faults, then a verdict on what must
hold however the faults fell.

The mix (weights with ``--mix``): trajectories of several ``exec`` actions in their own Docker sandbox (some of them
elastic), ephemeral ``exec`` actions, ``api`` calls proxied to the search upstream, ``lease`` actions (given back,
or left to expire) and ``reward`` calls on the MiniLM model. The faults: cancels of queued and of running actions,
clients that drop their ``?wait=true`` request mid-wait (and learn the action's fate by resubmitting under the same
idempotency key), ``docker kill`` of random sandbox containers of the broker (found by its ``org.arl-tangram.*``
labels), and commands that outlive their deadline.

The verdict (a table; JSON with ``--json``; exit code 1 when a check fails): actions submitted and per terminal
state; actions not in exactly one terminal state, read back through the API *and* from the store (every action's
stored state, and the transitions of a sample); units in use per resource once every lease is returned or expired;
environments left after a client's clean-up; sandbox containers left, with the broker up and after it stopped;
faults injected per kind; and lost = submitted - terminal. Every check expects zero.

    python -m loadtest.soak [--actions 3000] [--concurrency 24] [--seed 1] [--duration 1800] [--json]
                            [--cancel-rate 0.08] [--disconnect-rate 0.05] [--kill-rate 0.2] [--deadline-rate 0.02]
                            [--mix trajectory=2,ephemeral=2,api=4,lease=3,reward=3] [--engine URL] [--out DIR]
    python -m loadtest.soak --url http://broker:8300 [--store-url URL] [--engine URL --broker-id ID] ...

Without ``--url`` it starts the search upstream and a broker in this process from ``loadtest/broker.toml`` (its
SQLite store and log in ``--out``, its sandboxes on ``--engine`` under a fresh broker id) and stops it at the end.
With ``--url`` the broker keeps running; the store is read only with ``--store-url``, and containers are killed and
counted only with ``--engine`` and ``--broker-id``; the checks that cannot run are listed as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time
import tomllib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import docker
import docker.errors
import requests
from aiohttp import web
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.soak_faults import KILL_TIMEOUT_S, broker_sandboxes, kill_container, labelled_containers
from loadtest.soak_verdict import CHECKS, Verdict, render, store_problems
from loadtest.upstream import search_app
from tangram.config import parse_config
from tangram.service import running_broker
from tangram_client import ActionRecord, ApiError, AsyncTangramClient, ConflictError, TangramError, WaitTimeout

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reward model comes from a Python package

log = logging.getLogger("loadtest.soak")

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("trajectory", "ephemeral", "api", "lease", "reward")
DEFAULT_MIX = {"trajectory": 2, "ephemeral": 2, "api": 4, "lease": 3, "reward": 3}
FAULT_KINDS = ("cancel_queued", "cancel_running", "cancel_too_late", "disconnect", "container_kill", "deadline")
#: the resources each scenario needs, checked against the broker before anything is submitted
NEEDS = {"trajectory": "cpu", "ephemeral": "cpu", "api": "api.search", "lease": "lease.local", "reward": "gpu"}
REWARD_SERVICE = "minilm-judge"
SANDBOX_MEMORY_MB = 256
CANCELLED_COMMAND_SLEEP_S = 5  # long enough that a cancel aimed at a running command finds it running
OVERRUN_COMMAND_SLEEP_S = 30  # a command that must be killed by its deadline
RELEASED_LEASE_TTL_S = 60.0
WAIT_SLACK_S = 30.0  # past an action's deadline, the driver stops waiting for it (the checks then show it)
TEXTS = ("pytest runs tests in parallel with pytest-xdist", "a cgroup cpuset pins a container to its cores",
         "cosine similarity compares two embeddings", "one event loop serves many requests",
         "leases hold quota units while a model generates", "the broker queues every action first come first served")
TEST_ELASTICITY_T1_S = 0.5
REWARD_ELASTICITY = {"resource": "gpu", "t1": 0.2, "efficiency": {"1": 1.0, "2": 0.6}}


@dataclass(frozen=True)
class SoakOptions:
    actions: int = 3000
    concurrency: int = 24
    seed: int = 1
    duration_s: float = 1800.0
    cancel_rate: float = 0.08  # fraction of actions cancelled (half aimed at queued, half at running ones)
    disconnect_rate: float = 0.05  # fraction of actions whose ?wait=true request is dropped mid-wait
    kill_rate: float = 0.2  # sandbox containers killed per second
    deadline_rate: float = 0.02  # fraction of trajectory commands that outlive their deadline
    lease_expire_rate: float = 0.5  # fraction of leases left to expire instead of given back
    mix: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MIX))
    action_timeout_s: float = 120.0
    store_sample: int = 1000  # actions whose stored transitions are read back; 0: all
    task: str = ""  # default: soak-<run id>, so a store shared with other runs still tells this run's actions apart
    token: str | None = None

    def __post_init__(self) -> None:
        for name in ("cancel_rate", "disconnect_rate", "deadline_rate", "lease_expire_rate"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name.replace('_', '-')} must be between 0 and 1, not {value}")
        if self.cancel_rate + self.disconnect_rate > 1:
            raise ValueError("cancel-rate + disconnect-rate must be at most 1 (one fault per action)")
        if self.actions < 1 or self.concurrency < 1:
            raise ValueError("actions and concurrency must be at least 1")
        if self.kill_rate < 0 or self.duration_s <= 0 or self.action_timeout_s <= 0 or self.store_sample < 0:
            raise ValueError("kill-rate and store-sample must be >= 0; duration and timeout must be positive")
        if set(self.mix) - set(SCENARIOS) or not any(self.mix.values()) or min(self.mix.values()) < 0:
            raise ValueError(f"mix weights are whole numbers >= 0 for {list(SCENARIOS)}, at least one positive")


def parse_mix(raw: str) -> dict[str, int]:
    """``trajectory=4,api=3`` -> weights; scenarios left out weigh 0."""
    mix = dict.fromkeys(SCENARIOS, 0)
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, _, weight = item.partition("=")
        if name.strip() not in mix or not weight.strip().isdigit():
            raise ValueError(f"--mix {raw!r}: items are NAME=WEIGHT with NAME in {list(SCENARIOS)} and WEIGHT a "
                             f"whole number")
        mix[name.strip()] = int(weight)
    return mix


class SoakSetupError(Exception):
    """The broker cannot run the mix asked for; nothing was submitted."""


@dataclass(frozen=True)
class Target:
    """The broker under test and what the driver may inspect besides its API (None: that check is skipped)."""

    url: str
    store_url: str | None
    engine: str | None
    broker_id: str | None


@dataclass(frozen=True)
class Request:
    """One action the driver submits, and what a succeeded record must show."""

    scenario: str
    kind: str
    demand: dict[str, Any]
    spec: dict[str, Any]
    key: str
    check: Callable[[Any], str | None]  # a succeeded action's result -> what is wrong with it, or None
    timeout_s: float
    trajectory: str | None = None
    elasticity: dict[str, Any] | None = None
    overruns: bool = False  # the command outlives its deadline: it must not succeed

    def arguments(self) -> dict[str, Any]:
        return {"kind": self.kind, "demand": self.demand, "spec": self.spec, "trajectory": self.trajectory,
                "elasticity": self.elasticity, "timeout_s": self.timeout_s, "idempotency_key": self.key}


@dataclass
class Tracked:
    request: Request
    seen: str | None = None  # the first terminal state the driver saw
    cancel_answered: bool = False  # DELETE answered 200: the action must end cancelled
    lease_plan: str | None = None  # "released" or "expired"


class Ledger:
    """Everything the driver saw: the actions it got ids for, the faults it injected and the problems it met."""

    def __init__(self) -> None:
        self.actions: dict[str, Tracked] = {}
        self.faults: Counter[str] = Counter(dict.fromkeys(FAULT_KINDS, 0))
        self.problems: dict[str, list[str]] = {name: [] for name in CHECKS}
        self.error_codes: Counter[str] = Counter()
        self.kill_notes: Counter[str] = Counter()
        self.ended = 0
        self.lease_expiry = 0.0  # when the last lease left to expire comes back (Unix time)

    def submitted(self, request: Request, record: ActionRecord) -> Tracked:
        tracked = self.actions.get(record.id)
        if tracked is None:
            tracked = self.actions[record.id] = Tracked(request)
        return tracked

    def ended_with(self, tracked: Tracked, record: ActionRecord) -> None:
        """The terminal record of an action: its first terminal state, its error code, its result checked."""
        if tracked.seen is not None:
            return
        tracked.seen = record.state
        self.ended += 1
        request = tracked.request
        if record.error:
            self.error_codes[f"{request.kind}:{record.error.get('code')}"] += 1
            if record.error.get("code") == "internal":
                self.problem("internal_errors", f"{record.id}: {record.error.get('message')}")
        if tracked.cancel_answered and record.state != "cancelled":
            self.problem("cancel_not_honoured", f"{record.id}: cancel answered 200, action ended {record.state}")
        if record.state == "succeeded":
            wrong = "succeeded past its deadline" if request.overruns else request.check(record.result)
            if wrong:
                self.problem("wrong_results", f"{record.id} ({request.scenario}): {wrong}")

    def problem(self, check: str, detail: str) -> None:
        self.problems[check].append(detail)
        log.warning("%s: %s", check, detail)


# -- the checks of succeeded results -----------------------------------------------------------------------------

def stdout_is(expected: str) -> Callable[[Any], str | None]:
    def check(result: Any) -> str | None:
        if not isinstance(result, dict) or result.get("exit_code") != 0 or result.get("stdout") != expected:
            return f"expected exit 0 and stdout {expected!r}, got {json.dumps(result)[:300]}"
        return None
    return check


def elastic_stdout(seed: str, token: str) -> Callable[[Any], str | None]:
    """The command printed the core count the broker granted, and ran on exactly that many cores."""
    def check(result: Any) -> str | None:
        cores = result.get("cores") if isinstance(result, dict) else None
        if not isinstance(cores, list) or not cores:
            return f"no cores in {json.dumps(result)[:300]}"
        return stdout_is(f"{seed}\n{len(cores)} {token}\n")(result)
    return check


def search_result(query: str, k: int) -> Callable[[Any], str | None]:
    def check(result: Any) -> str | None:
        result = result if isinstance(result, dict) else {}
        body = result.get("body")
        if result.get("status") != 200 or not isinstance(body, dict) or body.get("query") != query \
                or len(body.get("results", [])) != k:
            return f"expected {k} results for {query!r}, got {json.dumps(result)[:300]}"
        return None
    return check


def scores_for(pairs: int) -> Callable[[Any], str | None]:
    def check(result: Any) -> str | None:
        scores = result.get("scores") if isinstance(result, dict) else None
        if not (isinstance(scores, list) and len(scores) == pairs
                and all(isinstance(s, float) and -1.0001 <= s <= 1.0001 for s in scores)):
            return f"expected {pairs} cosine scores, got {json.dumps(result)[:300]}"
        return None
    return check


def anything(_result: Any) -> str | None:
    return None


# -- the driver ---------------------------------------------------------------------------------------------------

class Soak:
    """Workers running scenarios until the action budget or the duration is spent, a container killer beside them,
    then the end-of-run checks against the broker's API."""

    def __init__(self, options: SoakOptions, target: Target, client: AsyncTangramClient,
                 raw: aiohttp.ClientSession) -> None:
        self.options = options
        self.target = target
        self.client = client
        self.raw = raw  # a session whose connections close with each request, to drop waits mid-way
        self.ledger = Ledger()
        self.run_id = uuid.uuid4().hex[:8]  # not from the seed: keys must never meet a previous run's
        self.budget = options.actions
        self.deadline = time.monotonic() + options.duration_s
        self.started = time.monotonic()
        self.cpu_max = 1

    # -- running ----------------------------------------------------------------------------------------------

    async def run(self, progress: bool) -> None:
        await self._check_broker()
        stop_killing = asyncio.Event()
        killer = asyncio.create_task(self._guarded("container killer", self._kill_containers(stop_killing)))
        reporter = asyncio.create_task(self._report(progress), name="soak-progress")
        try:
            await asyncio.gather(*(self._worker(i) for i in range(self.options.concurrency)))
        finally:
            stop_killing.set()
            await killer
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)

    async def _guarded(self, name: str, work: Awaitable[None]) -> None:
        """A bug of this driver goes into the verdict; the run goes on."""
        try:
            await work
        except Exception as error:
            log.exception("%s failed", name)
            self.ledger.problem("driver_errors", f"{name}: {error!r}")

    async def _check_broker(self) -> None:
        """Fail at once, naming the resource, when the broker lacks one the mix uses."""
        body = await self.client.resources()
        have = {row["resource"]: row["capacity"] for row in body["resources"]}
        missing = sorted({NEEDS[s] for s, weight in self.options.mix.items() if weight and NEEDS[s] not in have})
        if missing:
            raise SoakSetupError(f"the broker has no {', '.join(missing)} (it has {sorted(have)}); leave those "
                                 f"scenarios out with --mix")
        self.cpu_max = min(4, max((row["capacity"] for row in body["resources"] if row["resource"] == "cpu"),
                                  default=1))

    def _claim(self) -> bool:
        """Take one action from the budget; False once it is spent or the duration is over."""
        if self.budget <= 0 or time.monotonic() >= self.deadline:
            return False
        self.budget -= 1
        return True

    def _key(self, worker: int, rng: random.Random) -> str:
        return f"{self.run_id}-{worker}-{rng.getrandbits(48):012x}"

    async def _worker(self, worker: int) -> None:
        rng = random.Random(f"{self.options.seed}-worker-{worker}")
        names = list(self.options.mix)
        weights = [self.options.mix[name] for name in names]
        scenarios: dict[str, Callable[[int, random.Random], Awaitable[None]]] = {
            "trajectory": self._trajectory, "ephemeral": self._ephemeral, "api": self._api, "lease": self._lease,
            "reward": self._reward}
        while self.budget > 0 and time.monotonic() < self.deadline:
            scenario = rng.choices(names, weights)[0]
            await self._guarded(f"scenario {scenario}", scenarios[scenario](worker, rng))

    # -- scenarios ----------------------------------------------------------------------------------------------

    async def _trajectory(self, worker: int, rng: random.Random) -> None:
        """Several commands in one sandbox; each reads a file the sandbox was made with, so a command that ran in
        another trajectory's sandbox shows. A lost sandbox is deleted and the next command gets a fresh one."""
        name = f"traj-{self.run_id}-{worker}-{rng.getrandbits(32):08x}"
        seed = f"seed-{rng.getrandbits(32):08x}"
        files = {"seed.txt": seed + "\n"}  # sent while the trajectory has no sandbox: only a new one takes files
        submitted = False
        try:
            for _ in range(rng.randint(2, 6)):
                if not self._claim():
                    break
                submitted = True
                token = f"tok-{rng.getrandbits(32):08x}"
                fault = self._fault(rng)
                overruns = fault is None and rng.random() < self.options.deadline_rate
                elastic = not overruns and self.cpu_max > 1 and rng.random() < 0.3
                sleep_s = self._command_sleep(rng, fault)
                spec: dict[str, Any] = {"memory_mb": SANDBOX_MEMORY_MB}
                if not await self._has_environment(name):
                    spec["files"] = files
                demand: dict[str, Any] = {"cpu": 1}
                elasticity = None
                check = stdout_is(f"{seed}\n{token}\n")
                if overruns:
                    spec["command"] = f"sleep {OVERRUN_COMMAND_SLEEP_S}"
                    check = anything  # it must not succeed at all
                elif elastic:
                    spec["command"] = f"cat seed.txt && sleep {sleep_s} && echo $TANGRAM_NUM_CPUS {token}"
                    demand = {"cpu": {"min": 1, "max": self.cpu_max}}
                    efficiency = {"1": 1.0, str(self.cpu_max): 0.8}
                    elasticity = {"resource": "cpu", "t1": TEST_ELASTICITY_T1_S, "efficiency": efficiency}
                    check = elastic_stdout(seed, token)
                else:
                    spec["command"] = f"cat seed.txt && sleep {sleep_s} && echo {token}"
                timeout = rng.uniform(1.0, 2.5) if overruns else self.options.action_timeout_s
                request = Request("trajectory", "exec", demand, spec, self._key(worker, rng), check, timeout,
                                  trajectory=name, elasticity=elasticity, overruns=overruns)
                record = await self._act(rng, request, "deadline" if overruns else fault)
                if record is not None and record.error and record.error.get("code") == "environment_lost":
                    await self._delete_environment(record.error.get("environment"))
        finally:
            if submitted:
                await self._delete_trajectory_environments(name)

    async def _ephemeral(self, worker: int, rng: random.Random) -> None:
        """A command without a trajectory: its sandbox lives for this action only."""
        if not self._claim():
            return
        token = f"tok-{rng.getrandbits(32):08x}"
        fault = self._fault(rng)
        spec = {"command": f"sleep {self._command_sleep(rng, fault)} && echo {token}", "memory_mb": SANDBOX_MEMORY_MB}
        await self._act(rng, Request("ephemeral", "exec", {"cpu": 1}, spec, self._key(worker, rng),
                                     stdout_is(f"{token}\n"), self.options.action_timeout_s), fault)

    async def _api(self, worker: int, rng: random.Random) -> None:
        if not self._claim():
            return
        query, k = f"soak {rng.getrandbits(32):08x}", rng.randint(1, 5)
        spec = {"method": "GET", "path": "/search", "query": {"q": query, "k": k}}
        await self._act(rng, Request("api", "api", {"api.search": 1}, spec, self._key(worker, rng),
                                     search_result(query, k), self.options.action_timeout_s), self._fault(rng))

    async def _reward(self, worker: int, rng: random.Random) -> None:
        if not self._claim():
            return
        pairs = [list(rng.sample(TEXTS, 2)) for _ in range(rng.randint(1, 3))]
        spec = {"service": REWARD_SERVICE, "input": {"pairs": pairs}}
        await self._act(rng, Request("reward", "reward", {"gpu": {"choices": [1, 2]}}, spec, self._key(worker, rng),
                                     scores_for(len(pairs)), self.options.action_timeout_s,
                                     elasticity=REWARD_ELASTICITY), self._fault(rng))

    async def _lease(self, worker: int, rng: random.Random) -> None:
        """A lease given back after a short hold, or left to come back by its TTL. A cancelled one always gets a
        short TTL: a cancel that comes too late leaves it granted, and nobody gives it back."""
        if not self._claim():
            return
        fault = self._fault(rng)
        expires = (fault is not None and fault.startswith("cancel")) or rng.random() < self.options.lease_expire_rate
        ttl = rng.uniform(1.0, 3.0) if expires else RELEASED_LEASE_TTL_S
        request = Request("lease", "lease", {"lease.local": rng.randint(1, 2)}, {"ttl_s": ttl},
                          self._key(worker, rng), anything, self.options.action_timeout_s)
        record = await self._act(rng, request, fault)
        if record is None or record.state != "succeeded":
            return
        self.ledger.actions[record.id].lease_plan = "expired" if expires else "released"
        if expires:
            self.ledger.lease_expiry = max(self.ledger.lease_expiry, time.time() + ttl)
            return
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        try:
            released = await self.client.release_lease(record.id)
        except TangramError as error:
            self.ledger.problem("unexpected_http_errors", f"DELETE /v1/leases/{record.id}: {error}")
            return
        if (released.result or {}).get("returned") != "released":
            self.ledger.problem("leases_not_returned", f"{record.id}: release answered {released.result}")

    # -- one action with its fault ------------------------------------------------------------------------------

    def _fault(self, rng: random.Random) -> str | None:
        """The fault of one action: a cancel aimed at it queued or running, a dropped wait, or none."""
        draw = rng.random()
        if draw < self.options.cancel_rate:
            return "cancel_queued" if draw < self.options.cancel_rate / 2 else "cancel_running"
        if draw < self.options.cancel_rate + self.options.disconnect_rate:
            return "disconnect"
        return None

    @staticmethod
    def _command_sleep(rng: random.Random, fault: str | None) -> float:
        return CANCELLED_COMMAND_SLEEP_S if fault == "cancel_running" else rng.choice((0, 0.05, 0.1, 0.2, 0.5))

    async def _act(self, rng: random.Random, request: Request, fault: str | None) -> ActionRecord | None:
        """Submit the action, inject its fault and return its terminal record. None when the broker refused the
        submit (an unexpected HTTP error); the last record seen when the action outlived its deadline by
        ``WAIT_SLACK_S`` (the final checks count it)."""
        end_by = time.monotonic() + request.timeout_s + WAIT_SLACK_S
        try:
            record = await self._submit(rng, request, fault, end_by)
            tracked = self.ledger.submitted(request, record)
            if not record.terminal:
                record = await self.client.wait(record.id, timeout_s=max(end_by - time.monotonic(), 0.0))
            self.ledger.ended_with(tracked, record)
            return record
        except WaitTimeout as late:
            log.warning("%s still %s past its deadline", late.record.id, late.record.state)
            return late.record
        except TangramError as error:
            self.ledger.problem("unexpected_http_errors", f"{request.scenario} {request.key}: {error}")
            return None

    async def _submit(self, rng: random.Random, request: Request, fault: str | None, end_by: float) -> ActionRecord:
        """The action's record after its submit and fault (terminal, or not if the wait was dropped or cut)."""
        arguments = request.arguments()
        if fault == "disconnect":
            return await self._dropped_submit(rng, request)
        if fault in ("cancel_queued", "cancel_running"):
            record = await self.client.submit(**arguments)
            return await self._cancel(rng, self.ledger.submitted(request, record), record,
                                      aim_running=fault == "cancel_running")
        if fault == "deadline":
            self.ledger.faults["deadline"] += 1
        try:
            async with asyncio.timeout(end_by - time.monotonic()):
                return await self.client.submit(**arguments, wait=True)
        except TimeoutError:  # it did not end by its deadline: learn its id by its key, the checks show the rest
            return await self.client.submit(**arguments)

    async def _dropped_submit(self, rng: random.Random, request: Request) -> ActionRecord:
        """POST with ``?wait=true`` and hang up part-way; then learn the action by resubmitting under its key."""
        body = self.client.action_body(**request.arguments())
        url = f"{self.target.url}/v1/actions?wait=true&wait_timeout_s={request.timeout_s:g}"
        try:
            async with asyncio.timeout(rng.uniform(0.02, 0.8)):
                async with self.raw.post(url, json=body) as response:
                    payload = await response.json(content_type=None)
                    if response.status >= 400:
                        raise ApiError(response.status, "response", json.dumps(payload)[:300])
                    return ActionRecord.from_json(payload)  # answered before the hang-up: no fault injected
        except TimeoutError:
            self.ledger.faults["disconnect"] += 1
        return await self.client.submit(**request.arguments())

    async def _cancel(self, rng: random.Random, tracked: Tracked, record: ActionRecord,
                      aim_running: bool) -> ActionRecord:
        if aim_running:
            while not record.terminal and record.state != "running":
                await asyncio.sleep(0.1)
                record = await self.client.get(record.id)
            await asyncio.sleep(rng.uniform(0.0, 0.3))
        try:
            cancelled = await self.client.cancel(record.id)
        except ConflictError:
            self.ledger.faults["cancel_too_late"] += 1
            return await self.client.get(record.id)
        tracked.cancel_answered = True
        self.ledger.faults["cancel_running" if cancelled.raw.get("started_at") else "cancel_queued"] += 1
        return cancelled

    # -- environments -------------------------------------------------------------------------------------------

    async def _delete_environment(self, environment: str | None) -> None:
        if environment is None:
            return
        try:
            await self.client.delete_environment(environment)
        except TangramError as error:
            self.ledger.problem("unexpected_http_errors", f"DELETE /v1/environments/{environment}: {error}")

    async def _has_environment(self, trajectory: str) -> bool:
        """Whether the trajectory has its sandbox now (its commands run one after another, so nothing makes one
        meanwhile); a listing that fails counts as a problem, and as a sandbox (files then are not sent twice)."""
        try:
            environments = await self.client.environments()
        except TangramError as error:
            self.ledger.problem("unexpected_http_errors", f"GET /v1/environments: {error}")
            return True
        return any(environment.get("trajectory") == trajectory for environment in environments)

    async def _delete_trajectory_environments(self, trajectory: str) -> None:
        """What a client does when its trajectory ends: delete the sandbox, found by the trajectory's name."""
        try:
            environments = await self.client.environments()
        except TangramError as error:
            self.ledger.problem("unexpected_http_errors", f"GET /v1/environments: {error}")
            return
        for environment in environments:
            if environment.get("trajectory") == trajectory:
                await self._delete_environment(environment["id"])

    # -- container kills ----------------------------------------------------------------------------------------

    async def _kill_containers(self, stop: asyncio.Event) -> None:
        """``docker kill`` a random sandbox container of the broker, at ``kill_rate`` per second on average.

        Kills run on their own threads: killing a frozen sandbox can keep the engine's answer waiting for seconds,
        and the broker's own Docker calls share the loop's default executor."""
        if self.target.engine is None or self.target.broker_id is None or self.options.kill_rate == 0:
            return
        rng = random.Random(f"{self.options.seed}-killer")
        engine = docker.APIClient(base_url=self.target.engine, timeout=KILL_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        kills: list[asyncio.Task[None]] = []

        async def kill(container_id: str) -> None:
            outcome = await loop.run_in_executor(threads, kill_container, engine, container_id)
            if outcome is None:
                self.ledger.faults["container_kill"] += 1
            else:
                self.ledger.kill_notes[outcome] += 1

        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="soak-kill") as threads:
            try:
                while True:
                    try:
                        await asyncio.wait_for(stop.wait(), rng.expovariate(self.options.kill_rate))
                        break
                    except TimeoutError:
                        pass
                    try:
                        found = await loop.run_in_executor(threads, broker_sandboxes, engine, self.target.broker_id,
                                                           False)
                    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
                        self.ledger.kill_notes[f"listing failed: {error}"[:200]] += 1
                        continue
                    if found:
                        kills.append(asyncio.create_task(kill(rng.choice(sorted(c["Id"] for c in found)))))
                await asyncio.gather(*kills)
            finally:
                engine.close()

    # -- progress -----------------------------------------------------------------------------------------------

    def _status(self) -> str:
        faults = " ".join(f"{name}={count}" for name, count in self.ledger.faults.items() if count)
        return f"{len(self.ledger.actions)} submitted, {self.ledger.ended} ended; {faults or 'no faults yet'}"

    async def _report(self, progress: bool) -> None:
        if not progress:
            while True:
                await asyncio.sleep(10.0)
                print(f"soak: {time.monotonic() - self.started:.0f} s, {self._status()}", file=sys.stderr)
        columns = (TextColumn("soak"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[status]}"))
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("soak", total=self.options.actions, status="")
            while True:
                bar.update(task, completed=self.ledger.ended, status=self._status())
                await asyncio.sleep(0.5)

    # -- the checks with the broker up ----------------------------------------------------------------------

    async def final_states(self) -> dict[str, str]:
        """Every action's state as the API tells it now; each must be the terminal state the driver saw first."""
        states: dict[str, str] = {}
        limit = asyncio.Semaphore(16)

        async def read(action_id: str, tracked: Tracked) -> None:
            async with limit:
                try:
                    record = await self.client.get(action_id)
                except TangramError as error:
                    self.ledger.problem("unexpected_http_errors", f"GET /v1/actions/{action_id}: {error}")
                    return
            states[action_id] = record.state
            if tracked.request.kind == "lease" and record.state == "succeeded":
                returned = (record.result or {}).get("returned")
                if returned != tracked.lease_plan:
                    self.ledger.problem("leases_not_returned",
                                        f"{action_id}: planned {tracked.lease_plan}, the record says {returned}")

        await asyncio.gather(*(read(i, t) for i, t in self.ledger.actions.items()))
        return states

    async def wait_for_leases(self) -> None:
        """Until every lease left to expire has come back by its TTL (bounded: the check after shows the rest)."""
        bound = max(self.ledger.lease_expiry - time.time(), 0.0) + 15.0
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if (await self.client.resources())["stats"]["leases"] == 0:
                return
            await asyncio.sleep(0.25)

    async def clean_environments(self) -> tuple[int, list[str]]:
        """Delete the task's environments as a client would; how many there were, and the ids of those left."""
        before = await self.client.environments()
        for environment in before:
            await self._delete_environment(environment["id"])
        return len(before), [environment["id"] for environment in await self.client.environments()]

    async def units_in_use(self) -> tuple[dict[str, int], dict[str, Any]]:
        """Units held per resource (a quota-only resource counts what is held, not its window's use)."""
        body = await self.client.resources()
        units: Counter[str] = Counter()
        for row in body["resources"]:
            units[row["resource"]] += row["held"] if "held" in row else row["in_use"]
        return dict(units), body["stats"]


# -- running against a broker -------------------------------------------------------------------------------------

@asynccontextmanager
async def clients(options: SoakOptions, url: str) -> AsyncIterator[tuple[AsyncTangramClient, aiohttp.ClientSession]]:
    headers = {"Authorization": f"Bearer {options.token}"} if options.token else {}
    async with AsyncTangramClient(url, task=options.task, token=options.token, max_connections=200,
                                  request_timeout_s=60.0) as client, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                  headers=headers) as raw:
        yield client, raw


async def drive(options: SoakOptions, target: Target, progress: bool) -> Verdict:
    """The load, then every check that needs the broker up."""
    async with clients(options, target.url) as (client, raw):
        soak = Soak(options, target, client, raw)
        verdict = Verdict(options, soak)
        await soak.run(progress)
        await soak.wait_for_leases()
        verdict.states = await soak.final_states()
        verdict.environments_cleaned, left = await soak.clean_environments()
        for environment in left:
            soak.ledger.problem("environments_left", f"{environment} still listed after its DELETE")
        verdict.units, verdict.broker_stats = await soak.units_in_use()
        if target.engine and target.broker_id:
            for name in await asyncio.to_thread(labelled_containers, target.engine, target.broker_id):
                soak.ledger.problem("containers_left_broker_up", name)
        else:
            verdict.skipped["containers_left_broker_up"] = "no --engine and --broker-id"
        verdict.elapsed_s = time.monotonic() - soak.started
        return verdict


async def soak_remote(options: SoakOptions, target: Target, progress: bool = False) -> dict[str, Any]:
    """Soak a broker that keeps running (``--url``)."""
    options = with_task(options)
    verdict = await drive(options, target, progress)
    verdict.skipped["containers_left_after_stop"] = "the broker keeps running"
    verdict.skipped["broker_log_errors"] = "the broker's log is elsewhere"
    verdict.skipped["broker_stop_errors"] = "the broker keeps running"
    await check_store(verdict, options, target.store_url)
    return verdict.to_json()


async def soak_local(options: SoakOptions, make_config: Callable[[str], dict[str, Any]], log_path: Path,
                     progress: bool = False) -> dict[str, Any]:
    """Start the search upstream and a broker in this process (``make_config(upstream URL)``), soak it, stop it,
    then count what its stop left and read its store."""
    options = with_task(options)
    upstream = web.AppRunner(search_app(delay_s=0.05), access_log=None)
    await upstream.setup()
    await web.TCPSite(upstream, "127.0.0.1", 0).start()
    try:
        raw = make_config(f"http://127.0.0.1:{upstream.addresses[0][1]}")
        broker_id = raw["cpu"]["broker_id"]
        engine = next(iter(raw["cpu"]["nodes"].values()))["engine"]
        target_store = raw["store"]["url"]
        verdict: Verdict | None = None
        stop_error: Exception | None = None
        with captured_log(log_path) as errors:
            try:
                async with running_broker(parse_config(raw)) as (_, app):
                    runner = web.AppRunner(app, access_log=None)
                    await runner.setup()
                    await web.TCPSite(runner, "127.0.0.1", 0).start()
                    target = Target(f"http://127.0.0.1:{runner.addresses[0][1]}", target_store, engine, broker_id)
                    try:
                        verdict = await drive(options, target, progress)
                    finally:
                        await runner.cleanup()
            except Exception as error:  # the broker's stop failed: a finding, and what it left is counted below
                if verdict is None:
                    raise
                log.exception("the broker's stop failed")
                stop_error = error
        assert verdict is not None
        if stop_error is not None:
            verdict.soak.ledger.problem("broker_stop_errors", repr(stop_error)[:500])
        for record in errors:
            verdict.soak.ledger.problem("broker_log_errors", record)
        for name in await asyncio.to_thread(labelled_containers, engine, broker_id):
            verdict.soak.ledger.problem("containers_left_after_stop", name)
        await check_store(verdict, options, target_store)
        return verdict.to_json()
    finally:
        await upstream.cleanup()


def with_task(options: SoakOptions) -> SoakOptions:
    if options.task:
        return options
    return SoakOptions(**{**vars(options), "task": f"soak-{uuid.uuid4().hex[:8]}"})


async def check_store(verdict: Verdict, options: SoakOptions, store_url: str | None) -> None:
    if store_url is None:
        verdict.skipped["store_records"] = "no --store-url: terminal states checked through the API only"
        return
    verdict.store = await store_problems(store_url, options.task, verdict.states, options.store_sample,
                                         options.seed)


@contextmanager
def captured_log(path: Path) -> Iterator[list[str]]:
    """The broker's log at INFO into ``path``; yields the ERROR records as they come (each one is a finding)."""
    errors: list[str] = []

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not record.name.startswith("loadtest.soak"):
                errors.append(f"{record.name}: {record.getMessage()}".replace("\n", " | ")[:500])

    root = logging.getLogger()
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    counter = Errors(logging.ERROR)
    level = root.level
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    root.addHandler(to_file)
    root.addHandler(counter)
    try:
        yield errors
    finally:
        root.removeHandler(to_file)
        root.removeHandler(counter)
        root.setLevel(level)
        to_file.close()


def broker_config(upstream_url: str, store_url: str, *, broker_id: str,
                  node: dict[str, Any] | None = None) -> dict[str, Any]:
    """loadtest/broker.toml with its upstream, store and broker id replaced, and ``node`` merged into its sandbox
    node (``engine``, ``cores``, ``fast_path``, ...)."""
    raw = tomllib.loads((ROOT / "loadtest" / "broker.toml").read_text())
    raw["basic"]["api.search"]["upstream"]["base_url"] = upstream_url
    raw["store"] = {"url": store_url}
    raw["cpu"]["broker_id"] = broker_id
    raw["cpu"]["nodes"]["local"].update(node or {})
    return raw


# -- the command ---------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SoakOptions]:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    defaults = SoakOptions()
    parser.add_argument("--actions", type=int, default=defaults.actions, help="actions to submit")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="workers running scenarios")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--duration", type=float, default=defaults.duration_s,
                        help="seconds after which no new action starts (the ones under way finish)")
    parser.add_argument("--cancel-rate", type=float, default=defaults.cancel_rate)
    parser.add_argument("--disconnect-rate", type=float, default=defaults.disconnect_rate)
    parser.add_argument("--kill-rate", type=float, default=defaults.kill_rate, help="container kills per second")
    parser.add_argument("--deadline-rate", type=float, default=defaults.deadline_rate)
    parser.add_argument("--lease-expire-rate", type=float, default=defaults.lease_expire_rate)
    parser.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()))
    parser.add_argument("--timeout", type=float, default=defaults.action_timeout_s, help="wait per action")
    parser.add_argument("--store-sample", type=int, default=defaults.store_sample,
                        help="actions whose transitions are read from the store (0: all)")
    parser.add_argument("--task", default="", help="the RL task of every action (default soak-<random>)")
    parser.add_argument("--token", default=os.environ.get("TANGRAM_TOKEN"), help="bearer token, if the broker asks")
    parser.add_argument("--url", help="soak this running broker instead of starting one")
    parser.add_argument("--store-url", help="with --url: the broker's store, to read its records back")
    parser.add_argument("--engine", help="the Docker engine of the sandboxes (default: broker.toml's)")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="run commands with docker exec instead of the in-sandbox executor")
    parser.add_argument("--broker-id", help="with --url: the broker's cpu.broker_id, to find its containers")
    parser.add_argument("--out", type=Path, help="directory for the store, broker log and verdict.json")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON (the table goes to stderr)")
    args = parser.parse_args(argv)
    try:
        options = SoakOptions(actions=args.actions, concurrency=args.concurrency, seed=args.seed,
                              duration_s=args.duration, cancel_rate=args.cancel_rate,
                              disconnect_rate=args.disconnect_rate, kill_rate=args.kill_rate,
                              deadline_rate=args.deadline_rate, lease_expire_rate=args.lease_expire_rate,
                              mix=parse_mix(args.mix), action_timeout_s=args.timeout, store_sample=args.store_sample,
                              task=args.task, token=args.token)
    except ValueError as error:
        parser.error(str(error))
    if args.url is None and (args.store_url or args.broker_id):
        parser.error("--store-url and --broker-id go with --url (a broker this driver starts is known to it)")
    if args.url is not None and args.no_fast_path:
        parser.error("--no-fast-path configures the broker this driver starts; it does not go with --url")
    return args, options


async def main_async(args: argparse.Namespace, options: SoakOptions) -> dict[str, Any]:
    progress = sys.stderr.isatty()
    if args.url:
        target = Target(args.url.rstrip("/"), args.store_url, args.engine, args.broker_id)
        return await soak_remote(options, target, progress)
    out: Path = args.out
    broker_id = f"soak-{uuid.uuid4().hex[:8]}"
    node: dict[str, Any] = {"engine": args.engine} if args.engine else {}
    if args.no_fast_path:
        node["fast_path"] = False

    def make_config(upstream_url: str) -> dict[str, Any]:
        return broker_config(upstream_url, f"sqlite+aiosqlite:///{out / 'soak.db'}", broker_id=broker_id, node=node)

    print(f"soak: broker {broker_id}; store, log and verdict in {out}", file=sys.stderr)
    return await soak_local(options, make_config, out / "broker.log", progress)


def main(argv: list[str] | None = None) -> int:
    args, options = parse_args(argv)
    if args.url is None:
        args.out = (args.out or Path(tempfile.mkdtemp(prefix="tangram-soak."))).resolve()
        args.out.mkdir(parents=True, exist_ok=True)
    console = logging.StreamHandler()  # the soak's own findings; the broker's log goes to its file
    console.setFormatter(logging.Formatter("soak: %(levelname)s %(message)s"))
    log.addHandler(console)
    try:
        verdict = asyncio.run(main_async(args, options))
    except SoakSetupError as error:
        print(f"soak: {error}", file=sys.stderr)
        return 2
    if args.out is not None:
        (args.out / "verdict.json").write_text(json.dumps(verdict, indent=2))
    render(verdict, Console(stderr=args.json))
    if args.json:
        print(json.dumps(verdict, indent=2))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
