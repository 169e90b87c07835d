"""Buddy chunks of GPUs in one node (§5.3, multi-level cells as in HiveD).

A legal chunk is an interval of 1, 2, 4 or 8 GPUs aligned to its size. A node of N GPUs starts as the largest
aligned chunks that tile it (8 GPUs: one chunk of 8; 12 GPUs: 8 + 4; 6 GPUs: 4 + 2). Allocating k GPUs takes a
free chunk of the smallest level that fits, splitting it in halves down to k; releasing merges a chunk with its
free buddy, level by level, within the tile it came from.

Smallest-fit keeps one property the scheduler relies on: the free chunk *counts* per level after any sequence of
allocations depend only on the counts before and the sizes asked, not on which chunks were picked nor on the
order (power-of-two sizes). ``after_allocating`` is that transition; the DP operator (``chunk_operator.py``)
plans on it, so every plan it makes is one this allocator can carry out, in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

LEVELS = (1, 2, 4, 8)
#: free chunks per level, in LEVELS order
Counts = tuple[int, int, int, int]


@dataclass(frozen=True, order=True, slots=True)
class Chunk:
    start: int
    size: int

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))

    @property
    def buddy(self) -> Chunk:
        return Chunk(self.start ^ self.size, self.size)

    def contains(self, other: Chunk) -> bool:
        return self.start <= other.start and other.start + other.size <= self.start + self.size

    def halves(self) -> tuple[Chunk, Chunk]:
        half = self.size // 2
        return Chunk(self.start, half), Chunk(self.start + half, half)


def tiles(gpus: int) -> tuple[Chunk, ...]:
    """The largest aligned chunks (at most 8 GPUs) that tile ``gpus`` GPUs from index 0."""
    out: list[Chunk] = []
    start = 0
    while start < gpus:
        size = 8
        while start % size or start + size > gpus:
            size //= 2
        out.append(Chunk(start, size))
        start += size
    return tuple(out)


def counts_of(chunks: Iterable[Chunk]) -> Counts:
    counts = [0, 0, 0, 0]
    for chunk in chunks:
        counts[LEVELS.index(chunk.size)] += 1
    return counts[0], counts[1], counts[2], counts[3]


def after_allocating(counts: Counts, k: int) -> Counts | None:
    """Free counts after a smallest-fit allocation of ``k`` GPUs; None when no free chunk is large enough."""
    level = LEVELS.index(k)
    for taken in range(level, len(LEVELS)):
        if counts[taken]:
            out = list(counts)
            out[taken] -= 1
            for split in range(level, taken):  # splitting 2^taken down to k leaves one free half per level
                out[split] += 1
            return out[0], out[1], out[2], out[3]
    return None


#: ranks a candidate chunk; the allocator takes the smallest key among chunks of the chosen level
Preference = Callable[[Chunk], Any]


class ChunkAllocator:
    """Free and used chunks of one node's GPUs."""

    def __init__(self, gpus: int) -> None:
        if gpus < 1:
            raise ValueError("a GPU node needs at least one GPU")
        self.gpus = gpus
        self.tiles = tiles(gpus)
        self.free: set[Chunk] = set(self.tiles)
        self.used: set[Chunk] = set()

    def copy(self) -> ChunkAllocator:
        clone = ChunkAllocator.__new__(ChunkAllocator)
        clone.gpus, clone.tiles = self.gpus, self.tiles
        clone.free, clone.used = set(self.free), set(self.used)
        return clone

    @property
    def free_gpus(self) -> int:
        return sum(chunk.size for chunk in self.free)

    def counts(self) -> Counts:
        return counts_of(self.free)

    def fits(self, k: int) -> bool:
        return any(chunk.size >= k for chunk in self.free)

    def smallest_fitting_level(self, k: int) -> int | None:
        sizes = [chunk.size for chunk in self.free if chunk.size >= k]
        return min(sizes) if sizes else None

    def allocate(self, k: int, prefer: Preference | None = None) -> Chunk | None:
        """Take ``k`` GPUs (k in LEVELS) from the smallest free level that fits; None when none fits.

        Among the aligned k-chunks inside the free chunks of that level, ``prefer`` picks (e.g. one whose GPUs
        already hold the service); ties go to the lowest index.
        """
        if k not in LEVELS:
            raise ValueError(f"chunks have 1, 2, 4 or 8 GPUs, not {k}")
        level = self.smallest_fitting_level(k)
        if level is None:
            return None
        options = [(parent, Chunk(start, k)) for parent in self.free if parent.size == level
                   for start in range(parent.start, parent.start + level, k)]
        parent, target = min(options, key=lambda o: (prefer(o[1]) if prefer else 0, o[1].start))
        self.free.remove(parent)
        while parent.size > k:  # split towards the target, freeing the other half at each level
            low, high = parent.halves()
            parent, spare = (low, high) if low.contains(target) else (high, low)
            self.free.add(spare)
        self.used.add(target)
        return target

    def release(self, chunk: Chunk) -> None:
        """Free ``chunk`` and merge it with free buddies, never beyond the tile it belongs to."""
        self.used.remove(chunk)
        while True:
            buddy = chunk.buddy
            merged = Chunk(min(chunk.start, buddy.start), chunk.size * 2)
            if chunk.size >= 8 or buddy not in self.free or not any(t.contains(merged) for t in self.tiles):
                break
            self.free.remove(buddy)
            chunk = merged
        self.free.add(chunk)
