"""Synthetic traces shaped like the paper's workloads (§2.3, §6.1). Each parameter says where it comes from:
the paper where it gives a figure, otherwise an assumption stated here and in docs/EVALUATION.md.

All durations are lognormal (``median``, ``sigma``): agentic tool calls and test runs are long-tailed (§2.4,
§6.4). A trace is fully determined by the workload's parameters and the seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from tangram.sim.trace import Call, Trace, Trajectory

#: reward-model inference speed-up over GPUs (tensor parallel): E(m) at DoP 1/2/4/8 (assumed)
GPU_EFFICIENCY = ((1, 1.0), (2, 0.9), (4, 0.75), (8, 0.55))
#: a test run's E(m) is listed at every count of the paper's DoP range, 1-32 (§6.4), so that its speed-up is
#: Amdahl's at each count the malleable sharing gives it, not an interpolation between powers of two (which
#: is below Amdahl's concave curve: a fixed DoP at 2, 4, 8, ... would be favoured)
CPU_COUNTS = tuple(range(1, 33))


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, rng.lognormvariate(math.log(median), sigma)))


def _profiled(rng: random.Random, true_s: float, error: float) -> float:
    """A profiled estimate of ``true_s``: off by a lognormal factor (``error`` = its sigma)."""
    return true_s * rng.lognormvariate(0.0, error) if error > 0 else true_s


@dataclass(frozen=True)
class CodingParams:
    """AI coding (SWE-bench-like scaffold, §6.1): tool calls between generations, then a test run as reward."""

    batch: int = 1280  # trajectories per RL step (§6.1: 1,280 for AI coding)
    turns_median: float = 16.0  # tool calls per trajectory (assumed; SWE-style agents take tens of turns)
    think_median_s: float = 1.2  # LLM generation per turn: puts ~half of a pod's life in actions (§2.3: 47%)
    think_sigma: float = 0.6
    tool_median_s: float = 0.3  # a shell command or file edit ("down to 1 ms", §2.4); with the test runs, a
    tool_sigma: float = 1.5  # mean execution near Table 1's 0.975 s per action
    test_median_s: float = 20.0  # T1 of the reward test run on one core (assumed; long-tailed, §6.4)
    test_sigma: float = 1.0
    serial_low: float = 0.01  # Amdahl serial fraction of a test run, uniform in [low, high] (assumed)
    serial_high: float = 0.10
    profile_error: float = 0.25  # sigma of the profiled T1's error (§6.1: profiled in advance)
    memory_mb: int = 4096  # a sandbox's memory (assumed)
    task: str = "coding"


def ai_coding(params: CodingParams = CodingParams(), seed: int = 1) -> Trace:
    rng = random.Random(seed)
    trajectories = []
    for i in range(params.batch):
        turns = round(_lognormal(rng, params.turns_median, 0.5, 2, 80))
        calls = [Call("tool", _lognormal(rng, params.think_median_s, params.think_sigma, 0.05, 120),
                      _lognormal(rng, params.tool_median_s, params.tool_sigma, 0.001, 300))
                 for _ in range(turns)]
        serial = rng.uniform(params.serial_low, params.serial_high)
        efficiency = tuple((m, round(1.0 / (serial * m + 1.0 - serial), 4)) for m in CPU_COUNTS)
        work = _lognormal(rng, params.test_median_s, params.test_sigma, 1.0, 3600)
        calls.append(Call("test", _lognormal(rng, params.think_median_s, params.think_sigma, 0.05, 120), work,
                          efficiency=efficiency, estimate_s=_profiled(rng, work, params.profile_error)))
        trajectories.append(Trajectory(f"{params.task}-{i}", params.task, 0.0, tuple(calls), params.memory_mb))
    return Trace("ai_coding", seed, asdict(params), trajectories)


@dataclass(frozen=True)
class MopdParams:
    """MOPD (§2.2, §6.1): trajectories of several domains; each ends with log-probs from its domain's teacher.

    Domains differ in popularity (Zipf) and in generation length, so each teacher's load comes in waves that
    partly overlap (Fig. 3(b), 3(d))."""

    batch: int = 2048  # §6.1: 2,048 for MOPD
    teachers: int = 9  # §6.1: nine teacher models (ten services with DeepSearch's judge)
    zipf: float = 1.0  # domain popularity skew (assumed)
    think_median_s: float = 60.0  # generation of a whole trajectory, for the shortest domain (assumed)
    think_sigma: float = 0.5
    domain_spread: float = 4.0  # the longest domain generates this many times longer (assumed)
    logprob_median_s: float = 2.0  # teacher prefill of a trajectory on one GPU (assumed)
    logprob_sigma: float = 0.5
    profile_error: float = 0.25
    task: str = "mopd"


def teacher_names(n: int) -> tuple[str, ...]:
    return tuple(f"teacher{i}" for i in range(n))


def mopd(params: MopdParams = MopdParams(), seed: int = 1) -> Trace:
    rng = random.Random(seed)
    names = teacher_names(params.teachers)
    weights = [1.0 / (rank + 1) ** params.zipf for rank in range(params.teachers)]
    stretch = [1.0 + (params.domain_spread - 1.0) * d / max(1, params.teachers - 1) for d in range(params.teachers)]
    rng.shuffle(stretch)  # popularity and length independent
    trajectories = []
    for i in range(params.batch):
        d = rng.choices(range(params.teachers), weights)[0]
        think = _lognormal(rng, params.think_median_s * stretch[d], params.think_sigma, 1.0, 3600)
        work = _lognormal(rng, params.logprob_median_s, params.logprob_sigma, 0.05, 300)
        call = Call("reward", think, work, names[d], GPU_EFFICIENCY, _profiled(rng, work, params.profile_error))
        trajectories.append(Trajectory(f"{params.task}-{i}", params.task, 0.0, (call,)))
    return Trace("mopd", seed, asdict(params), trajectories)


@dataclass(frozen=True)
class SearchParams:
    """DeepSearch (BrowseComp-like, §6.1): search and fetch API calls under quotas, then an LLM-judge reward."""

    batch: int = 2048  # §6.1: 2,048 for DeepSearch
    turns_median: float = 12.0  # API calls per trajectory (assumed)
    think_median_s: float = 4.0  # generation per turn (assumed)
    think_sigma: float = 0.5
    fetch_share: float = 0.4  # share of calls that fetch a page rather than search (assumed)
    search_median_s: float = 1.0  # upstream latency (assumed)
    fetch_median_s: float = 2.0
    latency_sigma: float = 0.5
    judge_median_s: float = 3.0  # the judge's pass over a trajectory on one GPU (assumed)
    judge_sigma: float = 0.4
    profile_error: float = 0.25
    task: str = "search"


def deepsearch(params: SearchParams = SearchParams(), seed: int = 1) -> Trace:
    rng = random.Random(seed)
    trajectories = []
    for i in range(params.batch):
        turns = round(_lognormal(rng, params.turns_median, 0.5, 1, 60))
        calls = []
        for _ in range(turns):
            fetch = rng.random() < params.fetch_share
            latency = _lognormal(rng, params.fetch_median_s if fetch else params.search_median_s,
                                 params.latency_sigma, 0.05, 60)
            calls.append(Call("api", _lognormal(rng, params.think_median_s, params.think_sigma, 0.05, 120), latency,
                              "api.fetch" if fetch else "api.search"))
        work = _lognormal(rng, params.judge_median_s, params.judge_sigma, 0.1, 300)
        calls.append(Call("reward", _lognormal(rng, params.think_median_s, params.think_sigma, 0.05, 120), work,
                          "judge", GPU_EFFICIENCY, _profiled(rng, work, params.profile_error)))
        trajectories.append(Trajectory(f"{params.task}-{i}", params.task, 0.0, tuple(calls)))
    return Trace("deepsearch", seed, asdict(params), trajectories)


def merged(name: str, *traces: Trace) -> Trace:
    """Several RL tasks running at once on the same resources (§6.1: MOPD + DeepSearch)."""
    trajectories = [t for trace in traces for t in trace.trajectories]
    return Trace(name, traces[0].seed, {trace.workload: trace.params for trace in traces}, trajectories)
