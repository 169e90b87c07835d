"""DPArrange (Appendix B, Algorithm 3): optimal discrete allocation of units among scalable candidates.

Two readings of the paper are fixed here (docs/SCHEDULING.md, departures):

* Greedy eviction only ever drops the *last* candidate, so the DP row ``t`` already is the optimum for the
  prefix of length ``t``: one table answers every prefix (``DPTable.best(t)``).
* Algorithm 3 returns ``dp[m][n]`` (exactly ``n`` units used). With ``E(m) < 1`` more units can be slower, so
  the answer is the best state *within* ``n`` (``j <= n`` for counted units).

Operators carry the topology. ``BasicOperator`` (state = units used, ``next(j, k) = j + k``) is linear, which lets
the table be filled with numpy one row at a time. Any other operator goes through the generic loop, which walks
*forward* from each reachable state and records every state's parent: a topology whose allocation is a
deterministic function of the state before (the GPU chunk operator) may reach one state from several, so a
``prev`` that undoes an allocation is not always defined, while ``next`` always is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

INF = math.inf


class DPOperator(Protocol):
    """The topology primitives of Algorithm 3. State 0 is "nothing allocated yet"; every state is a legal end."""

    #: True when ``next(j, k) == j + k``: the table can be filled with vector operations
    linear: bool

    def end(self, free_units: int) -> int:
        """The largest state index reachable with ``free_units``."""

    def next(self, j: int, k: int) -> int | None:
        """The state after giving ``k`` more units in state ``j``; None (or a state past ``end``) if impossible."""


class BasicOperator:
    """Counted, interchangeable units (CPU cores in one node, API tokens): state = units used."""

    linear = True

    def end(self, free_units: int) -> int:
        return free_units

    def next(self, j: int, k: int) -> int | None:
        return j + k


@dataclass(slots=True)
class DPTable:
    """Filled DP table for candidates in FCFS order; answers the optimum of every prefix."""

    values: np.ndarray  # (m + 1, n + 1): best total duration of the first i tasks ending in state j
    choices: np.ndarray  # (m + 1, n + 1): units given to task i in that optimum (0 = unreachable)
    parents: np.ndarray | None  # (m + 1, n + 1): state before task i in that optimum; None: ``j - choice``

    @property
    def size(self) -> int:
        return self.values.shape[0] - 1

    def best(self, t: int, limit: int | None = None) -> tuple[float, list[int]]:
        """Total duration and per-task units of the optimum for the first ``t`` tasks (inf, [] if infeasible), in
        states up to ``limit`` (for a linear operator: using at most ``limit`` units)."""
        if t == 0:
            return 0.0, []
        row = self.values[t] if limit is None else self.values[t, :max(0, limit) + 1]
        j = int(np.argmin(row))
        total = float(row[j])
        if total == INF:
            return INF, []
        units = [0] * t
        for i in range(t, 0, -1):
            k = int(self.choices[i, j])
            units[i - 1] = k
            j = j - k if self.parents is None else int(self.parents[i, j])
        return total, units


def dp_arrange(options: Sequence[tuple[Sequence[int], Sequence[float]]], free_units: int,
               operator: DPOperator | None = None) -> DPTable:
    """Fill the DP for tasks given as (allowed unit counts ascending, duration at each count).

    Only counts not above ``free_units`` are considered. A prefix that cannot fit is reported as inf.
    """
    operator = operator or BasicOperator()
    end = operator.end(free_units)
    m = len(options)
    values = np.full((m + 1, end + 1), INF)
    choices = np.zeros((m + 1, end + 1), dtype=np.int32)
    values[0, 0] = 0.0
    if operator.linear:
        _fill_linear(options, values, choices, end)
        return DPTable(values, choices, None)
    parents = np.zeros((m + 1, end + 1), dtype=np.int32)
    _fill_generic(options, values, choices, parents, operator, end)
    return DPTable(values, choices, parents)


def _fill_linear(options: Sequence[tuple[Sequence[int], Sequence[float]]], values: np.ndarray,
                 choices: np.ndarray, end: int) -> None:
    """Row i: ``dp[i][j] = min_k dp[i-1][j-k] + T_i(k)``, one gather over a sliding window per row."""
    width = end + 1
    low = 0  # fewest units the first i tasks can use; states below are unreachable
    for i, (counts, durations) in enumerate(options, start=1):
        ks = np.asarray(counts, dtype=np.int64)
        keep = ks <= end
        ks, ts = ks[keep], np.asarray(durations, dtype=np.float64)[keep]
        if ks.size == 0:
            return  # this prefix and every longer one are infeasible: rows stay inf
        low += int(ks[0])
        if low > end:
            return
        kmax = int(ks[-1])
        padded = np.concatenate((np.full(kmax, INF), values[i - 1]))
        window = sliding_window_view(padded, kmax + 1)[low:width]  # window[r, s] = dp[i-1][low + r + s - kmax]
        cand = window[:, kmax - ks] + ts
        at = np.argmin(cand, axis=1)
        best = cand[np.arange(cand.shape[0]), at]
        reachable = best < INF
        values[i, low:width] = best
        choices[i, low:width] = np.where(reachable, ks[at], 0)


def _fill_generic(options: Sequence[tuple[Sequence[int], Sequence[float]]], values: np.ndarray,
                  choices: np.ndarray, parents: np.ndarray, operator: DPOperator, end: int) -> None:
    """Algorithm 3 pushed forward: from every reachable state of row i-1, give task i each allowed count."""
    for i, (counts, durations) in enumerate(options, start=1):
        before, after = values[i - 1], values[i]
        for j in np.flatnonzero(before < INF).tolist():
            base = before[j]
            for k, t in zip(counts, durations):
                nxt = operator.next(j, k)
                if nxt is not None and nxt <= end and base + t < after[nxt]:
                    after[nxt] = base + t
                    choices[i, nxt] = k
                    parents[i, nxt] = j
