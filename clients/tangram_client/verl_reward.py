"""A verl custom reward function that scores a response with broker actions.

Two ways to score, picked by ``reward_kwargs``:

* **tests** (default): the response's code (its last fenced code block, else the whole text) goes into a fresh
  sandbox beside ``ground_truth`` as ``test_solution.py`` (pytest tests that import from ``solution``); they run as
  one elastic ``exec`` action with ``pytest_parallel``, so the broker's ``pytest`` becomes ``pytest -n N`` on the N
  cores it grants. The tests never import the code into pytest: ``solution`` is a shim that runs it in a process of
  its own (``tangram_client/solution_proxy.py``), and the score comes from a line the pytest plugin
  ``tangram_client/reward_report.py`` signs with a key only pytest holds (``tangram_client/signed_report.py``),
  never from what the solution can print. The score is passed / (collected - skipped) tests: 0 when no signed report
  came back (the solution killed pytest, none were collected), or the run was killed for time or memory or lost its
  sandbox. The default sandbox image has pytest and pytest-xdist.
* **reward model**: with ``service`` set, a ``reward`` action asks that broker reward service (task
  ``similarity``) to compare the response with ``ground_truth``; the score is the service's score.

verl loads it with::

    reward.custom_reward_function.path=pkg://tangram_client.verl_reward
    reward.custom_reward_function.name=compute_score          # or compute_score_async
    +reward.custom_reward_function.reward_kwargs.broker_url=http://127.0.0.1:8300

``compute_score`` is the synchronous form verl's reward managers run in a thread pool; ``compute_score_async`` is
awaited on the reward loop directly (verl checks ``inspect.iscoroutinefunction``). Both return a dict: ``score``
plus numeric details verl logs as ``reward_extra_info``. A process's rewards share one broker session per event
loop (``compute_score`` runs them on one loop of its own), not one each. A broker with auth takes
``reward_kwargs.token`` or ``$TANGRAM_TOKEN``. Broker errors (unreachable, a rejected action, a sandbox
that could not be made) raise: a reward must never be silently zero because the broker is misconfigured.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tangram_client.client import AsyncTangramClient
from tangram_client.errors import ActionError
from tangram_client.signed_report import KEY_FILE, read_signed
from tangram_client.verl_tool import DEFAULT_URL, LoopClients, core_range

#: a fenced code block; the last one in a response is taken as its solution
FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)```", re.DOTALL)
#: ends of a test run that started which are the solution's fault: they score 0 rather than raise. A sandbox lost
#: under the command is one: where the kernel has no Landlock scopes the solution can kill every process of its uid,
#: the sandbox's executor included (the score's ``sandbox_lost`` detail says so)
SOLUTION_FAULTS = frozenset({"timed_out", "out_of_memory", "environment_lost"})
TEST_COMMAND = "python3 -m pytest -q -p no:cacheprovider -p tangram_client.reward_report test_solution.py"
#: our modules a test run's sandbox holds (under ``tangram_client/``, with an empty ``__init__.py``)
SHIPPED_MODULES = ("solution_wire", "solution_proxy", "solution_runner", "pytest_guard", "signed_report",
                   "reward_report")
#: where the response's code goes; ``solution.py`` is the shim that runs it
SOLUTION_CODE = "_solution/solution.py"
SOLUTION_SHIM = ('"""The solution under test, run in a process of its own (tangram_client/solution_proxy.py)."""\n\n'
                 "from tangram_client.solution_proxy import install\n\n"
                 f"install(__name__, {SOLUTION_CODE!r})\n")


def extract_code(solution_str: str) -> str:
    """The last fenced code block of a response, or the whole response when it has none."""
    blocks = FENCE.findall(solution_str)
    return blocks[-1] if blocks else solution_str


@functools.cache
def _shipped_sources() -> dict[str, str]:
    here = Path(__file__).resolve().parent
    return {f"tangram_client/{name}.py": (here / f"{name}.py").read_text() for name in SHIPPED_MODULES}


def sandbox_files(code: str, tests: str, key: str) -> dict[str, str]:
    """What a test run's sandbox starts with: the tests, the code behind the ``solution`` shim, our modules, and
    the report's key (read and deleted by pytest before the code can run)."""
    return {**_shipped_sources(), "tangram_client/__init__.py": "", "solution.py": SOLUTION_SHIM, SOLUTION_CODE: code,
            "test_solution.py": tests, KEY_FILE: key}


def plain(value: Any) -> Any:
    """OmegaConf containers (verl passes ``reward_kwargs`` values as they are) as plain dicts and lists."""
    if isinstance(value, Mapping) or hasattr(value, "keys"):
        return {str(key): plain(value[key]) for key in value}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(item) for item in value]
    return value


def elasticity_for(resource: str, counts: tuple[int, int], t1_s: float | None,
                   efficiency: Mapping[str, float] | None) -> dict[str, Any] | None:
    """An elasticity object when the demand is a range: ``efficiency`` as given (default 1.0 at the minimum and
    0.7 at the maximum: a test run does not scale perfectly), and ``t1`` if known; without it the broker learns
    the duration per signature and runs the first actions at their minimum."""
    low, high = counts
    if low == high:
        return None
    body: dict[str, Any] = {"resource": resource,
                            "efficiency": {str(k): float(v) for k, v in plain(efficiency).items()} if efficiency
                            else {str(low): 1.0, str(high): 0.7}}
    if t1_s is not None:
        body["t1"] = float(t1_s)
    return body


async def compute_score_async(data_source: str, solution_str: str, ground_truth: Any,
                              extra_info: Mapping[str, Any] | None = None, *, broker_url: str | None = None,
                              task: str = "verl-reward", cores: Any = (1, 4), t1_s: float | None = None,
                              efficiency: Mapping[str, float] | None = None, timeout_s: float = 300.0,
                              image: str | None = None, memory_mb: int | None = None, service: str | None = None,
                              gpus: Any = 1, retries: int = 3, token: str | None = None,
                              reward_router_address: Any = None, reward_model_tokenizer: Any = None
                              ) -> dict[str, float]:
    """Score one response (see the module's docstring). ``broker_url`` defaults to ``$TANGRAM_URL`` or the local
    broker, ``token`` to ``$TANGRAM_TOKEN``; ``cores``/``gpus`` take a count or ``[min, max]``;
    ``reward_router_address`` and ``reward_model_tokenizer`` are verl's own extras for its reward-model router and
    are ignored."""
    del extra_info, reward_router_address, reward_model_tokenizer
    client = shared_client(broker_url or os.environ.get("TANGRAM_URL") or DEFAULT_URL, task, retries, token)
    if service is not None:
        return await _reward_model_score(client, data_source, solution_str, ground_truth, service=service,
                                         gpus=core_range(plain(gpus), "gpus"), t1_s=t1_s, efficiency=efficiency,
                                         timeout_s=timeout_s)
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth must be the pytest source of the tests, got {type(ground_truth).__name__}")
    return await _test_score(client, data_source, extract_code(solution_str), ground_truth,
                             cores=core_range(plain(cores), "cores"), t1_s=t1_s, efficiency=efficiency,
                             timeout_s=timeout_s, image=image, memory_mb=memory_mb)


#: the clients this process's rewards share: per (broker, task, retries, token), one per event loop
_CLIENTS: dict[tuple[str, str, int, str | None], LoopClients] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(url: str, task: str, retries: int, token: str | None) -> AsyncTangramClient:
    """The running loop's client for these settings, made on first use and kept for the process's later rewards
    (a session per reward would open a connection per reward)."""
    with _CLIENTS_LOCK:
        clients = _CLIENTS.get((url, task, retries, token))
        if clients is None:
            clients = _CLIENTS[(url, task, retries, token)] = LoopClients(url, task, retries, token)
    return clients.current()


async def close_shared_clients() -> None:
    """Close the running loop's shared reward sessions. verl's reward loop lives as long as its process, and
    ``compute_score``'s closes itself at exit; a caller that runs ``compute_score_async`` on a loop of its own
    calls this before that loop ends."""
    with _CLIENTS_LOCK:
        every = list(_CLIENTS.values())
    await asyncio.gather(*(clients.close() for clients in every))


class RewardLoop:
    """One event loop per process, on a daemon thread, for the blocking ``compute_score``: its rewards then share
    that loop's broker session. A forked child makes its own (the thread does not survive a fork). At interpreter
    exit the loop closes its sessions and stops before modules are torn down: a session collected then, from the
    main thread while the loop still runs, is a teardown the interpreter may not survive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        atexit.register(self.stop)

    def get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                self._loop, self._pid = asyncio.new_event_loop(), os.getpid()
                self._thread = threading.Thread(target=self._loop.run_forever, name="tangram-rewards", daemon=True)
                self._thread.start()
            return self._loop

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close this process's reward sessions and end the loop (the next ``get`` starts a new one)."""
        with self._lock:
            loop, thread, mine = self._loop, self._thread, self._pid == os.getpid()
            self._loop = self._thread = None
        if loop is None or thread is None or not mine or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(close_shared_clients(), loop).result(timeout_s)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            if not thread.is_alive():
                loop.close()


REWARD_LOOP = RewardLoop()


async def _test_score(client: AsyncTangramClient, data_source: str, code: str, tests: str, *,
                      cores: tuple[int, int], t1_s: float | None, efficiency: Mapping[str, float] | None,
                      timeout_s: float, image: str | None, memory_mb: int | None) -> dict[str, float]:
    key = secrets.token_hex(32)
    spec: dict[str, Any] = {"command": TEST_COMMAND, "pytest_parallel": True,
                            "files": sandbox_files(code, tests, key)}
    spec.update({key: value for key, value in (("image", image), ("memory_mb", memory_mb)) if value is not None})
    record = await client.submit("exec", {"cpu": cores}, spec, elasticity=elasticity_for("cpu", cores, t1_s,
                                                                                          efficiency),
                                 timeout_s=timeout_s, signature=f"verl-reward-tests:{data_source}", wait=True)
    ran = record.timings.get("execution_s") is not None
    if not record.succeeded and not (ran and (record.error or {}).get("code") in SOLUTION_FAULTS):
        raise ActionError(record)  # not the solution's doing (a queue deadline, a sandbox not made): no score
    outcome: dict[str, Any] = (record.result if record.succeeded else record.error) or {}
    report = read_signed(outcome.get("stderr") or "", key.encode()) if record.succeeded else None
    passed, total = (report["passed"], report["collected"] - report["skipped"]) if report else (0, 0)
    return {"score": passed / total if total > 0 else 0.0, "tests_passed": float(passed),
            "tests_total": float(total), "reported": float(report is not None),
            "sandbox_lost": float((record.error or {}).get("code") == "environment_lost"),
            "exit_code": float(-1 if outcome.get("exit_code") is None else outcome["exit_code"]),
            "cores": float(len(outcome.get("cores") or []))}


async def _reward_model_score(client: AsyncTangramClient, data_source: str, solution_str: str, ground_truth: Any,
                              *, service: str, gpus: tuple[int, int], t1_s: float | None,
                              efficiency: Mapping[str, float] | None, timeout_s: float) -> dict[str, float]:
    counts = list(range(gpus[0], gpus[1] + 1))
    demand = gpus[0] if gpus[0] == gpus[1] else [n for n in counts if n & (n - 1) == 0]  # chunks are powers of two
    record = await client.run("reward", {"gpu": demand},
                              {"service": service, "input": {"pairs": [[solution_str, str(ground_truth)]]}},
                              elasticity=elasticity_for("gpu", gpus, t1_s, efficiency), timeout_s=timeout_s,
                              signature=f"verl-reward-model:{data_source}")
    return {"score": float(record.result["scores"][0]), "gpus": float(len(record.result.get("gpus") or []))}


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None,
                  **reward_kwargs: Any) -> dict[str, float]:
    """The blocking form of ``compute_score_async`` (same arguments), run on the process's reward loop (verl's
    reward managers call it from a thread pool; concurrent calls run concurrently there)."""
    coroutine = compute_score_async(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)
    return asyncio.run_coroutine_threadsafe(coroutine, REWARD_LOOP.get()).result()
