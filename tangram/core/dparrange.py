"""DPArrange (Appendix B, Algorithm 3): optimal discrete allocation of units among scalable candidates.

Two readings of the paper are fixed here (docs/SCHEDULING.md, departures):

* Greedy eviction only ever drops the *last* candidate, so the DP row ``t`` already is the optimum for the
  prefix of length ``t``: one table answers every prefix (``DPTable.best(t)``).
* Algorithm 3 returns ``dp[m][n]`` (exactly ``n`` units used). With ``E(m) < 1`` more units can be slower, so
  the answer is the best state *within* ``n`` (``j <= n`` for counted units).

Operators carry the topology. ``BasicOperator`` (state = units used, ``next(j, k) = j + k``) is linear, which lets
the table be filled with numpy one row at a time (every pool's row ``i`` in one set of calls), and lets a row hold
only the units its tasks use *above their minimums*: the first ``i`` tasks use at least the sum of their minimums,
and a prefix of at least ``shortest`` tasks leaves at most ``free - (minimums of the first shortest)`` above them, so
states past that band are never on the path of an optimum it is asked for. Greedy eviction drops a few members from
a group that fills its units, so the band is narrow. Any other operator goes through the generic loop, which walks
*forward* from each reachable state and records every state's parent: a topology whose allocation is a
deterministic function of the state before (the GPU chunk operator) may reach one state from several, so a
``prev`` that undoes an allocation is not always defined, while ``next`` always is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Protocol

import numpy as np

INF = math.inf


class DPOperator(Protocol):
    """The topology primitives of Algorithm 3. State 0 is "nothing allocated yet"; every state is a legal end."""

    #: True when ``next(j, k) == j + k``: the table can be filled with vector operations
    linear: bool

    def end(self, free_units: int) -> int:
        """The largest state index reachable with ``free_units``."""

    def next(self, j: int, k: int) -> int | None:
        """The state after giving ``k`` more units in state ``j``; None (or a state past ``end``) if impossible."""


#: one pool's DP: its tasks' (allowed unit counts ascending, duration at each count), its free units, its operator
#: (None: ``BasicOperator``) and the shortest prefix its table answers
Problem = tuple[Sequence[tuple[Sequence[int], Sequence[float]]], int, DPOperator | None, int]


class BasicOperator:
    """Counted, interchangeable units (CPU cores in one node, API tokens): state = units used."""

    linear = True

    def end(self, free_units: int) -> int:
        return free_units

    def next(self, j: int, k: int) -> int | None:
        return j + k


@dataclass(slots=True)
class DPTable:
    """Filled DP table for candidates in FCFS order; answers the optimum of every prefix (a linear operator's: of
    at least ``shortest`` tasks)."""

    #: (m + 1, width): best total duration of the first i tasks ending in state j; for a linear operator, in state
    #: ``lows[i] + j`` (j units above the first i tasks' minimums)
    values: np.ndarray
    #: (m + 1, width): units given to task i in that optimum (0 = unreachable); for a linear operator, units above
    #: its minimum (unreachable states hold any)
    choices: np.ndarray
    parents: np.ndarray | None  # (m + 1, width): state before task i in that optimum; None: linear
    lows: list[int] | None = None  # linear: units the first i tasks use at their minimums
    shortest: int = 0  # linear: the shortest prefix the band holds
    minimums: list[int] = field(default_factory=list)  # linear: each task's minimum
    #: linear: (m + 1, width) the duration of task i on its minimum + x units (inf: not allowed or past the band);
    #: generic: None, and ``options`` holds them
    extra: np.ndarray | None = None
    options: Sequence[tuple[Sequence[int], Sequence[float]]] = ()  # generic: the tasks' counts and durations
    #: linear: ``choices`` as lists, made at the first ``best``: a walk back reads one cell per task, and a list
    #: cell costs a fraction of a numpy one
    choice_rows: list[list[int]] | None = None

    @property
    def size(self) -> int:
        return self.values.shape[0] - 1

    def best(self, t: int, limit: int | None = None) -> tuple[float, list[int]]:
        """Total duration and per-task units of the optimum for the first ``t`` tasks (inf, [] if infeasible), in
        states up to ``limit`` (for a linear operator: using at most ``limit`` units)."""
        if t == 0:
            return 0.0, []
        if self.lows is not None:
            return self._best_linear(t, limit)
        row = self.values[t] if limit is None else self.values[t, :max(0, limit) + 1]
        j = int(np.argmin(row))
        total = float(row[j])
        if total == INF:
            return INF, []
        units = [0] * t
        for i in range(t, 0, -1):
            k = int(self.choices[i, j])
            units[i - 1] = k
            j = int(self.parents[i, j])  # type: ignore[index]
        return total, units

    def durations(self, units: Sequence[int]) -> np.ndarray:
        """The duration of each of the first ``len(units)`` tasks on its units, as ``best`` gives them: the
        completion times of a plan, read from the table instead of asked of the model again."""
        if self.extra is not None:
            t = len(units)
            above = np.array(units, dtype=np.intp) - np.array(self.minimums[:t], dtype=np.intp)
            return self.extra[np.arange(1, t + 1), above]
        return np.array([durations[list(counts).index(k)] for (counts, durations), k in zip(self.options, units)],
                        dtype=float)

    def _best_linear(self, t: int, limit: int | None) -> tuple[float, list[int]]:
        if t < self.shortest:
            raise ValueError(f"prefix {t} is shorter than the {self.shortest} tasks this table's band holds")
        lows = self.lows
        assert lows is not None
        width = self.values.shape[1]
        top = width - 1 if limit is None else min(width - 1, max(0, limit) - lows[t])
        if top < 0:
            return INF, []
        row = self.values[t, :top + 1]
        j = int(np.argmin(row))
        total = float(row[j])
        if total == INF:
            return INF, []
        units = self.minimums[:t]  # each at its minimum, but those above it in the optimum
        if self.choice_rows is None:
            self.choice_rows = self.choices.tolist()
        rows = self.choice_rows
        i = t
        while j > 0:  # j units above the minimums of the first i tasks
            above = rows[i][j]
            units[i - 1] += above
            j -= above
            i -= 1
        return total, units


def dp_arrange(options: Sequence[tuple[Sequence[int], Sequence[float]]], free_units: int,
               operator: DPOperator | None = None, shortest: int = 0) -> DPTable:
    """Fill the DP for tasks given as (allowed unit counts ascending, duration at each count).

    Only counts not above ``free_units`` are considered. A prefix that cannot fit is reported as inf. A linear
    operator's table answers the prefixes of at least ``shortest`` tasks (fewer raise ValueError).
    """
    return dp_arrange_many([(options, free_units, operator, shortest)])[0]


def dp_arrange_many(problems: Sequence[Problem]) -> list[DPTable]:
    """``dp_arrange`` of each problem, the linear ones filled together row by row: a row costs numpy's calls more
    than its width, so one set of calls for every pool's row ``i`` is the cheap way to fill many pools."""
    tables: list[DPTable | None] = [None] * len(problems)
    linear: list[tuple[int, Sequence[tuple[Sequence[int], Sequence[float]]], int, int]] = []
    for index, (options, free_units, operator, shortest) in enumerate(problems):
        operator = operator or BasicOperator()
        end = operator.end(free_units)
        if operator.linear:
            linear.append((index, options, end, min(shortest, len(options))))
        else:
            tables[index] = _generic_table(options, end, operator)
    for (index, *_), table in zip(linear, _fill_linear([problem[1:] for problem in linear])):
        tables[index] = table
    return [table for table in tables if table is not None]


def _generic_table(options: Sequence[tuple[Sequence[int], Sequence[float]]], end: int,
                   operator: DPOperator) -> DPTable:
    m = len(options)
    values = np.full((m + 1, end + 1), INF)
    choices = np.zeros((m + 1, end + 1), dtype=np.int32)
    values[0, 0] = 0.0
    parents = np.zeros((m + 1, end + 1), dtype=np.int32)
    _fill_generic(options, values, choices, parents, operator, end)
    return DPTable(values, choices, parents, options=options)


def _fill_linear(problems: Sequence[tuple[Sequence[tuple[Sequence[int], Sequence[float]]], int, int]]
                 ) -> list[DPTable]:
    """Row i of every pool: ``dp[i][e] = min_x dp[i-1][e-x] + T_i(min_i + x)`` over the band of ``e`` units above
    the minimums, one gather per row; a count a task does not allow costs inf, and the candidates go in ascending
    count, so ties go to the fewest units, as over a full row."""
    if not problems:
        return []
    lows_of: list[list[int]] = []
    bands: list[int] = []
    for options, end, shortest in problems:
        lows = [0]
        for counts, _ in options:
            lows.append(lows[-1] + (counts[0] if counts else end + 1))
        lows_of.append(lows)
        bands.append(max(0, end - lows[shortest]))
    pools, width, rows = len(problems), max(bands) + 1, max(len(options) for options, _, _ in problems)
    pad = width - 1  # values[i, p, pad + e]: pool p's first i tasks, e units above their minimums; below: inf
    flat: list[int] = []  # indices into ``extra`` flattened, and the durations that go there
    flat_durations: list[float] = []
    tops = np.full((rows + 1, pools), -1)
    for p, ((options, end, _), lows, band) in enumerate(zip(problems, lows_of, bands)):
        for i, (counts, durations) in enumerate(options, start=1):
            top = min(band, end - lows[i])  # states past ``end`` units do not exist
            if top < 0:
                break  # this prefix and every longer one are infeasible: rows stay inf
            tops[i, p] = top
            base = (i * pools + p) * width - counts[0]
            if counts[-1] - counts[0] == len(counts) - 1:  # a range of counts, the common case
                n = min(len(counts), top + 1)
                flat.extend(range(base + counts[0], base + counts[0] + n))
                flat_durations.extend(durations[:n])
            else:
                for k, duration in zip(counts, durations):
                    if k - counts[0] <= top:
                        flat.append(base + k)
                        flat_durations.append(duration)
    extra = np.full((rows + 1, pools, width), INF)  # extra[i, p, x]: pool p's task i on its minimum + x units
    extra.reshape(-1)[flat] = flat_durations
    states = np.arange(width)
    reach = np.where(states <= tops[:, :, None], 0.0, INF)  # 0 on the states row i holds, inf past them
    values = np.full((rows + 1, pools, pad + width), INF)
    values[0, :, pad] = 0.0
    choices = np.zeros((rows + 1, pools, width), dtype=np.int32)
    # cand[p, x, e] = values[i - 1, p, pad + e - x]: reduced along x, numpy's fast axis for small rows
    gather = ((np.arange(pools) * (pad + width))[:, None, None] + pad - states[None, :, None]
              + states[None, None, :])
    for i in range(1, rows + 1):
        cand = values[i - 1].take(gather)
        cand += extra[i][:, :, None]
        at = cand.argmin(axis=1)
        best = cand.min(axis=1)
        best += reach[i]
        values[i, :, pad:] = best
        choices[i] = at
    return [DPTable(values[:len(options) + 1, p, pad:pad + band + 1], choices[:len(options) + 1, p, :band + 1],
                    None, lows, shortest, [high - low for low, high in pairwise(lows)],
                    extra[:len(options) + 1, p, :band + 1])
            for p, ((options, _, shortest), lows, band) in enumerate(zip(problems, lows_of, bands))]


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
