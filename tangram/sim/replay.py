"""Real-mode replay: the calls of a (small, time-compressed) trace sent to a running broker over REST.

The same trajectories the simulator drives on its virtual clock are driven here on the wall clock: one asyncio task
per trajectory sleeps through each call's generation time, submits the call as the action a client would send
(``broker_station.action_for``'s shape: tool calls on one core, test runs elastic on 1..N cores), waits for the
answer, and goes on. Each command really burns CPU for the call's true duration on the cores it was granted, so the
broker's measured ACTs can be set beside the simulator's prediction for the same trace (``compare``).

Only ``tool`` and ``test`` calls can be replayed: rewards need GPUs and API calls need upstreams that a replay does
not stand up.

    python -m tangram.sim.replay --url http://127.0.0.1:8300 --batch 8 --compress 20 --seed 1 [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any, TypeGuard

import aiohttp

from tangram.core.action import Demand
from tangram.sched.profile import DEFAULT_PROFILE
from tangram.sim import policies
from tangram.sim.cluster import Cluster
from tangram.sim.engine import Stalled, simulate
from tangram.sim.records import CallRecord, RunResult
from tangram.sim.trace import Call, Trace, Trajectory, compressed
from tangram.sim.workloads import CodingParams, ai_coding

#: call kinds a replay can send
REPLAYABLE = ("tool", "test")
#: the elastic range of a test run (as in the simulator, §6.4), capped by the broker's largest node
MAX_TEST_CORES = 32
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "timed_out"})

#: a tool call: burn argv[1] seconds of CPU on one core (the interpreter's own start-up counts towards it)
TOOL_CODE = "import sys,time\nw=float(sys.argv[1])\nwhile time.process_time()<w:pass"
#: a test run: TANGRAM_NUM_CPUS processes, each burning w/(E(n)*n) seconds of CPU, E interpolated like
#: ``Elasticity.efficiency_at`` from argv[2] ("m:E,m:E,...")
TEST_CODE = """import os,sys,time
w=float(sys.argv[1]);n=max(1,int(os.environ.get("TANGRAM_NUM_CPUS","1")))
p=[(int(a),float(b)) for a,b in (x.split(":") for x in sys.argv[2].split(","))]
e=p[0][1] if n<=p[0][0] else p[-1][1]
for (m0,e0),(m1,e1) in zip(p,p[1:]):
 if m0<=n<=m1:
  e=e0+(e1-e0)*(n-m0)/(m1-m0);break
d=w/(e*n);k=[]
def burn(t):
 while time.process_time()<t:pass
for i in range(n-1):
 c=os.fork()
 if c==0:
  burn(time.process_time()+d);os._exit(0)
 k.append(c)
burn(d)
for c in k:os.waitpid(c,0)
print(n,round(d,6))"""


class ReplayError(RuntimeError):
    """The broker refused a call or answered something a replay cannot use."""


def check_replayable(trace: Trace) -> None:
    """Raise ValueError naming the first call kind a replay cannot send (before anything is sent)."""
    for trajectory in trace.trajectories:
        for index, call in enumerate(trajectory.calls):
            if call.kind not in REPLAYABLE:
                raise ValueError(f"a replay sends only {'/'.join(REPLAYABLE)} calls; trajectory {trajectory.id!r} "
                                 f"call {index} is a {call.kind!r} call (it needs "
                                 f"{'GPUs' if call.kind == 'reward' else 'an upstream API'} the replay does not "
                                 f"stand up)")


def command_for(call: Call) -> list[str]:
    """The argv that burns ``call``'s true CPU time on the cores granted (``TANGRAM_NUM_CPUS``)."""
    if call.kind == "tool":
        return ["python3", "-c", TOOL_CODE, repr(call.work_s)]
    table = ",".join(f"{m}:{e!r}" for m, e in call.efficiency) or "1:1.0"
    return ["python3", "-c", TEST_CODE, repr(call.work_s), table]


def action_body(trajectory: Trajectory, call: Call, max_cores: int, *, timeout_s: float,
                idempotency_key: str | None = None, fixed_dop: int | None = None) -> dict[str, Any]:
    """The JSON action a client sends for ``call`` (the REST form of ``broker_station.action_for``); with
    ``fixed_dop``, a test run asks for exactly that many cores and declares no elasticity (a fixed-DoP user)."""
    if call.kind not in REPLAYABLE:
        raise ValueError(f"a replay sends only {'/'.join(REPLAYABLE)} calls, not {call.kind!r}")
    body: dict[str, Any] = {"task": trajectory.task, "trajectory": trajectory.id, "kind": "exec",
                            "spec": {"command": command_for(call), "memory_mb": trajectory.memory_mb},
                            "timeout_s": timeout_s}
    if call.kind == "tool":
        body["demand"] = {"cpu": 1}
        body["signature"] = "exec|tool"
    elif fixed_dop is not None:
        body["demand"] = {"cpu": fixed_dop}
        body["signature"] = "exec|test"
    else:
        body["demand"] = {"cpu": {"min": 1, "max": max_cores} if max_cores > 1 else 1}
        body["signature"] = "exec|test"
        elasticity = call.elasticity("cpu")
        if elasticity is not None:
            body["elasticity"] = elasticity.to_json()
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    return body


def with_memory(trace: Trace, memory_mb: int) -> Trace:
    """The same trace with every trajectory's sandbox reserving ``memory_mb``."""
    trajectories = [dataclasses.replace(t, memory_mb=memory_mb) for t in trace.trajectories]
    return Trace(trace.workload, trace.seed, {**trace.params, "memory_mb": memory_mb}, trajectories)


async def broker_resources(url: str, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
    async with session.get(url.rstrip("/") + "/v1/resources") as response:
        if response.status != 200:
            raise ReplayError(f"GET /v1/resources answered {response.status}: {await response.text()}")
        return (await response.json())["resources"]


def cluster_of(resources: Sequence[dict[str, Any]]) -> Cluster:
    """The simulator's cluster matching the broker's CPU nodes (nodes of unequal size: the largest is taken)."""
    cpu = [r for r in resources if r["resource"] == "cpu"]
    if not cpu:
        raise ReplayError("the broker has no CPU nodes (enable [cpu] in its config)")
    nodes = {r["pool"] for r in cpu}
    memory = [r["capacity"] for r in resources if r["resource"] == "memory_mb" and r["pool"] in nodes]
    return Cluster(cpu_nodes=len(cpu), cores_per_node=max(r["capacity"] for r in cpu),
                   **({"node_memory_mb": min(memory)} if memory else {}))


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def record_of(answer: dict[str, Any], trajectory: Trajectory, index: int, submit_s: float,
              elapsed_s: float) -> CallRecord:
    """A call's record from the broker's terminal answer; ``submit_s`` is when the client sent it (relative to the
    replay start) and ``elapsed_s`` how long the client waited for the answer (used only where timings lack)."""
    call = trajectory.calls[index]
    timings = answer.get("timings") or {}
    reported = timings.get("act_s")
    act = reported if _number(reported) else elapsed_s
    reported = timings.get("queue_s")
    queue = reported if _number(reported) else act  # never started: all of it was queueing
    reported = timings.get("execution_s")
    execution = reported if _number(reported) else 0.0
    result = answer.get("result")
    measured = result.get("duration_s") if isinstance(result, dict) else None
    exec_s = measured if _number(measured) else execution
    broker_overhead = timings.get("overhead_s")
    overhead = max(0.0, execution - exec_s) + (broker_overhead if _number(broker_overhead) else 0.0)
    allocation = answer.get("allocation") or {}
    units = int((allocation.get("units") or {}).get("cpu", 0))
    placement = (allocation.get("placement") or {}).get("cpu") or {}
    return CallRecord(trajectory.id, index, call.kind, call.target, submit_s, submit_s + queue, submit_s + act,
                      exec_s, overhead, units, str(placement.get("node", "")), 1, answer.get("state") != "succeeded")


def _environment_of(answer: dict[str, Any]) -> str | None:
    for part in (answer.get("result"), answer.get("error")):
        if isinstance(part, dict):
            for holder in (part, part.get("details")):
                if isinstance(holder, dict) and isinstance(holder.get("environment"), str):
                    return holder["environment"]
    return None


class _Replay:
    def __init__(self, trace: Trace, url: str, session: aiohttp.ClientSession, max_cores: int, *,
                 wait_timeout_s: float, action_timeout_s: float, retries: int, fixed_dop: int | None) -> None:
        self.trace = trace
        self.fixed_dop = fixed_dop
        self.url = url.rstrip("/")
        self.session = session
        self.max_cores = max_cores
        self.wait_timeout_s = wait_timeout_s
        self.action_timeout_s = action_timeout_s
        self.retries = retries
        self.run_id = uuid.uuid4().hex[:12]
        self.loop = asyncio.get_running_loop()
        self.t0 = 0.0
        self.records: list[CallRecord] = []
        self.rtts: list[float] = []
        self.lags: list[float] = []
        self.environments_deleted = 0

    def now(self) -> float:
        return self.loop.time() - self.t0

    async def _request(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        """One request, retried on connection errors (submits carry an idempotency key, so a retry never makes a
        second action)."""
        for attempt in range(self.retries + 1):
            try:
                async with self.session.request(method, self.url + path, **kwargs) as response:
                    if response.content_type == "application/json":
                        return response.status, await response.json()
                    return response.status, await response.text()
            except (aiohttp.ClientConnectionError, TimeoutError):
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.1 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _call(self, trajectory: Trajectory, index: int) -> tuple[dict[str, Any], float, float]:
        """Submit call ``index`` and wait for its terminal answer: (answer, sent at, answered at)."""
        call = trajectory.calls[index]
        body = action_body(trajectory, call, self.max_cores, timeout_s=self.action_timeout_s,
                           idempotency_key=f"replay-{self.run_id}-{trajectory.id}-{index}", fixed_dop=self.fixed_dop)
        wait = {"wait": "true", "wait_timeout_s": str(self.wait_timeout_s)}
        sent = self.now()
        status, answer = await self._request("POST", "/v1/actions", params=wait, json=body)
        if status not in (200, 202) or not isinstance(answer, dict):
            raise ReplayError(f"submitting {trajectory.id} call {index} ({call.kind}) answered {status}: {answer}")
        while answer.get("state") not in TERMINAL:
            status, answer = await self._request("GET", f"/v1/actions/{answer['id']}", params=wait)
            if status != 200 or not isinstance(answer, dict):
                raise ReplayError(f"waiting for {trajectory.id} call {index} answered {status}: {answer}")
        return answer, sent, self.now()

    async def _trajectory(self, trajectory: Trajectory) -> None:
        due = trajectory.start_s
        environment = None
        try:
            for index, call in enumerate(trajectory.calls):
                due += call.think_s
                delay = due - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                answer, sent, answered = await self._call(trajectory, index)
                self.lags.append(max(0.0, sent - due))
                record = record_of(answer, trajectory, index, sent, answered - sent)
                self.records.append(record)
                self.rtts.append(max(0.0, (answered - sent) - record.act_s))
                environment = _environment_of(answer) or environment
                due = answered
        finally:
            if environment is not None:  # the trajectory is over: free its sandbox, as the simulator does
                await self._delete(environment)

    async def _delete(self, environment: str) -> None:
        try:
            status, _ = await self._request("DELETE", f"/v1/environments/{environment}")
        except (aiohttp.ClientError, TimeoutError):
            return  # best effort: the broker's idle TTL reclaims it
        self.environments_deleted += status == 200

    async def run(self) -> RunResult:
        started = time.perf_counter()
        self.t0 = self.loop.time()
        async with asyncio.TaskGroup() as group:
            for trajectory in self.trace.trajectories:
                group.create_task(self._trajectory(trajectory), name=f"replay-{trajectory.id}")
        self.records.sort(key=lambda r: (r.submit_s, r.trajectory, r.index))
        stats: dict[str, Any] = {
            "wall_s": time.perf_counter() - started,
            "client_rtt_s_mean": statistics.fmean(self.rtts) if self.rtts else 0.0,
            "client_rtt_s_max": max(self.rtts, default=0.0),
            "submit_lag_s_mean": statistics.fmean(self.lags) if self.lags else 0.0,
            "max_test_cores": self.max_cores,
            "environments_deleted": self.environments_deleted,
            # other load on the client's host (the broker's too when it runs here) stretches real execution
            "client_host_load_1m": os.getloadavg()[0],
        }
        return RunResult("real", self.records, stats)


async def replay(trace: Trace, url: str, *, session: aiohttp.ClientSession | None = None,
                 wait_timeout_s: float = 60.0, action_timeout_s: float = 600.0, max_cores: int | None = None,
                 retries: int = 3, fixed_dop: int | None = None) -> RunResult:
    """Send every call of ``trace`` to the broker at ``url`` on the wall clock and record what it measured.

    Virtual time zero is the replay's start. A call is sent when its trajectory's previous answer came back (or at
    ``start_s``) plus its ``think_s``; the client round trip beyond the broker's ACT is reported as
    ``client_rtt_s_mean``. ``max_cores`` bounds a test run's elastic range (default: the broker's largest CPU
    node, at most 32); ``fixed_dop`` sends test runs at exactly that many cores instead. ``wait_timeout_s`` is one
    long poll (at most the broker's ``max_wait_s``); ``action_timeout_s`` each action's deadline. A trajectory's
    environment is deleted after its last call.
    """
    check_replayable(trace)
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=None, sock_read=wait_timeout_s + 60))
    try:
        if max_cores is None:
            cluster = cluster_of(await broker_resources(url, session))
            max_cores = min(MAX_TEST_CORES, cluster.cores_per_node)
        return await _Replay(trace, url, session, max_cores, wait_timeout_s=wait_timeout_s,
                             action_timeout_s=action_timeout_s, retries=retries, fixed_dop=fixed_dop).run()
    finally:
        if own:
            await session.close()


def _ratio(real: float, simulated: float) -> float | None:
    return real / simulated if simulated > 0 else None


async def compare(trace: Trace, url: str, cluster: Cluster | None = None, *,
                  session: aiohttp.ClientSession | None = None, **options: Any) -> dict[str, Any]:
    """The simulator's prediction and the real broker's figures for the same trace, and their ratios.

    ``cluster`` defaults to the broker's CPU nodes (``cluster_of``). The simulated broker gets the same elastic
    range for test runs as the replay sends (1..min(32, largest node)), and the default scheduler profile (a broker's
    API does not tell its own). ``options`` go to ``replay``.
    """
    check_replayable(trace)
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=None))
    try:
        if cluster is None:
            cluster = cluster_of(await broker_resources(url, session))
        max_cores = options.pop("max_cores", None) or min(MAX_TEST_CORES, cluster.cores_per_node)
        demand = Demand.range(1, max_cores) if max_cores > 1 else Demand.fixed(1)
        simulated = simulate(trace, cluster, policies.broker(DEFAULT_PROFILE, test_demand=demand),
                             "simulated").summary()
        real = (await replay(trace, url, session=session, max_cores=max_cores, **options)).summary()
    finally:
        if own:
            await session.close()
    return {"simulated": simulated, "real": real,
            "ratio_real_over_sim": {key: _ratio(real[key], simulated[key])
                                    for key in ("mean_act_s", "mean_trajectory_act_s")}}


ROWS = ("calls", "failed_calls", "mean_trajectory_act_s", "mean_act_s", "p50_act_s", "p99_act_s", "mean_exec_s",
        "mean_queue_s", "mean_overhead_s", "makespan_s")
KIND_ROWS = ("calls", "mean_act_s", "mean_exec_s", "mean_queue_s", "mean_overhead_s", "mean_units", "failed")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def side_by_side(comparison: dict[str, Any]) -> str:
    """The two summaries as a text table, with real/simulated for every figure."""
    sim, real = comparison["simulated"], comparison["real"]
    lines = [f"{'figure':<34}{'simulated':>14}{'real':>14}{'real/sim':>10}"]

    def row(name: str, a: Any, b: Any) -> None:
        ratio = _ratio(b, a) if _number(a) and _number(b) else None
        lines.append(f"{name:<34}{_cell(a):>14}{_cell(b):>14}{_cell(ratio):>10}")

    for key in ROWS:
        row(key, sim.get(key), real.get(key))
    for kind in sorted(set(sim["by_kind"]) | set(real["by_kind"])):
        for key in KIND_ROWS:
            row(f"{kind}.{key}", sim["by_kind"].get(kind, {}).get(key), real["by_kind"].get(kind, {}).get(key))
    lines.append(f"client round trip beyond ACT: mean {real.get('client_rtt_s_mean', 0.0) * 1e3:.2f} ms, "
                 f"submit lag mean {real.get('submit_lag_s_mean', 0.0) * 1e3:.2f} ms, "
                 f"client host load (1 min) {real.get('client_host_load_1m', 0.0):.2f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tangram.sim.replay",
                                     description="Replay a time-compressed AI-coding trace against a running broker "
                                                 "and compare with the simulator's prediction.")
    parser.add_argument("--url", default="http://127.0.0.1:8300", help="the broker")
    parser.add_argument("--batch", type=int, default=8, help="trajectories")
    parser.add_argument("--compress", type=float, default=20.0, help="divide every duration by this")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--turns", type=float, default=None, help="median tool calls per trajectory (default: "
                                                                   "the workload's)")
    parser.add_argument("--memory-mb", type=int, default=None,
                        help="memory each trajectory's sandbox reserves (default: the workload's)")
    parser.add_argument("--wait-timeout", type=float, default=60.0, help="one long poll, in seconds")
    parser.add_argument("--json", help="write both summaries and the ratios here")
    return parser


def build_trace(batch: int, compress: float, seed: int, turns: float | None = None,
                memory_mb: int | None = None) -> Trace:
    params = CodingParams(batch=batch)
    if turns is not None:
        params = dataclasses.replace(params, turns_median=turns)
    trace = compressed(ai_coding(params, seed), compress)
    return with_memory(trace, memory_mb) if memory_mb is not None else trace


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.batch < 1 or not args.compress > 0:
        print("--batch must be at least 1 and --compress positive", file=sys.stderr)
        return 2
    trace = build_trace(args.batch, args.compress, args.seed, args.turns, args.memory_mb)
    try:
        comparison = asyncio.run(compare(trace, args.url, wait_timeout_s=args.wait_timeout))
    except Stalled as error:
        print(f"the simulator predicts that the broker never finishes this trace ({error}): the trajectories' "
              f"sandboxes probably reserve more memory than the node has, and the calls queued behind those waiting "
              f"for memory hold up the trajectories that hold it. Nothing was sent; try a smaller --memory-mb or "
              f"--batch.", file=sys.stderr)
        return 1
    except (aiohttp.ClientError, ReplayError, OSError) as error:
        print(f"replay against {args.url} failed: {error}", file=sys.stderr)
        return 1
    print(f"trace: ai_coding batch={args.batch} seed={args.seed} compressed x{args.compress:g}: "
          f"{len(trace.trajectories)} trajectories, {trace.calls} calls")
    print(side_by_side(comparison))
    ratios = comparison["ratio_real_over_sim"]
    print("real/simulated: " + ", ".join(f"{k} {_cell(v)}" for k, v in ratios.items()))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(comparison, out, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
