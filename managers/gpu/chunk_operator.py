"""The GPU-topology DP operator (Appendix B, Algorithm 4), made to agree with the buddy allocator.

Algorithm 4 encodes a state as chunk counts per level (a, b, c, d) in mixed radix and decomposes a demand k
greedily over existing chunks without splitting, though §5.3's allocator splits. Here a state is the *free* chunk
counts after the group's allocations so far, and ``next`` is exactly the allocator's smallest-fit transition
(``chunks.after_allocating``), splits included. So every plan the DP returns is one the allocator can make.

Several states can lead to the same state (taking a free 1 from (2, 1, 0, 0) and splitting a 4 from (0, 0, 1, 0)
both give (1, 1, 0, 0)), which is why DPArrange's generic path walks forward and keeps parents. The states are
the ones reachable from the start by allocations: at most 270 for an 8-GPU node, enumerated once and numbered
from 0 (the start).
"""

from __future__ import annotations

from managers.gpu.chunks import LEVELS, Counts, after_allocating


class ChunkOperator:
    linear = False

    def __init__(self, start: Counts) -> None:
        self.states: list[Counts] = [start]
        self.index: dict[Counts, int] = {start: 0}
        self.transitions: list[dict[int, int]] = []
        at = 0
        while at < len(self.states):  # breadth-first over allocations of every level
            moves: dict[int, int] = {}
            for k in LEVELS:
                after = after_allocating(self.states[at], k)
                if after is None:
                    continue
                if after not in self.index:
                    self.index[after] = len(self.states)
                    self.states.append(after)
                moves[k] = self.index[after]
            self.transitions.append(moves)
            at += 1

    def end(self, free_units: int) -> int:
        return len(self.states) - 1

    def next(self, j: int, k: int) -> int | None:
        return self.transitions[j].get(k)
