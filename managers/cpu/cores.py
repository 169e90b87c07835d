"""One node's cores: exclusive to one action at a time, chosen inside one NUMA node when possible (§5.2)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from sandboxes.cgroup import parse_cpu_list


def host_numa_nodes(cores: Iterable[int]) -> list[list[int]]:
    """The host's NUMA nodes restricted to ``cores`` (from sysfs); one group when sysfs says nothing."""
    wanted = set(cores)
    groups = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"),
                       key=lambda p: int(p.name.removeprefix("node"))):
        try:
            listed = parse_cpu_list((node / "cpulist").read_text())
        except OSError:
            continue
        group = [c for c in listed if c in wanted]
        if group:
            groups.append(group)
    covered = {c for g in groups for c in g}
    if covered != wanted:
        groups.append(sorted(wanted - covered))
    return groups


class CorePool:
    """Free and busy cores of one node, grouped by NUMA node."""

    def __init__(self, numa: Sequence[Sequence[int]]) -> None:
        self.numa = [tuple(sorted(group)) for group in numa if group]
        seen: set[int] = set()
        for group in self.numa:
            if seen & set(group):
                raise ValueError(f"core(s) {sorted(seen & set(group))} listed in two NUMA nodes")
            seen |= set(group)
        self.cores = tuple(sorted(seen))
        self.free: set[int] = set(seen)
        self._group = {core: i for i, group in enumerate(self.numa) for core in group}

    @property
    def capacity(self) -> int:
        return len(self.cores)

    @property
    def in_use(self) -> int:
        return len(self.cores) - len(self.free)

    def take(self, n: int) -> tuple[int, ...]:
        """Take ``n`` free cores: the fullest NUMA node that still fits them all (keeping emptier nodes whole
        for wider actions), else spread over the nodes with the most free cores."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} cores with {len(self.free)} free: scheduler and manager disagree")
        free_by_group = [sorted(self.free.intersection(group)) for group in self.numa]
        fitting = [g for g in free_by_group if len(g) >= n]
        if fitting:
            chosen = min(fitting, key=len)[:n]
        else:
            chosen = []
            for group in sorted(free_by_group, key=len, reverse=True):
                chosen.extend(group[:n - len(chosen)])
                if len(chosen) == n:
                    break
        self.free.difference_update(chosen)
        return tuple(chosen)

    def shrink(self, cores: Sequence[int], n: int) -> tuple[int, ...]:
        """Keep ``n`` of a running action's ``cores`` (those in the NUMA nodes holding most of them) and free the
        rest; returns the cores kept."""
        per_group = Counter(self._group[c] for c in cores)

        def locality(core: int) -> tuple[int, int]:
            return -per_group[self._group[core]], core
        kept = tuple(sorted(sorted(cores, key=locality)[:n]))
        self.give_back(set(cores) - set(kept))
        return kept

    def grow(self, cores: Sequence[int], n: int) -> tuple[int, ...]:
        """Add ``n`` free cores to a running action's ``cores``, from the NUMA nodes it already uses first; returns
        all its cores."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} more cores with {len(self.free)} free: scheduler and manager disagree")
        used = {self._group[c] for c in cores}
        order = sorted(range(len(self.numa)), key=lambda g: (g not in used, -sum(c in self.free for c in self.numa[g])))
        added: list[int] = []
        for g in order:
            added.extend(c for c in self.numa[g] if c in self.free)
            if len(added) >= n:
                break
        added = added[:n]
        self.free.difference_update(added)
        return tuple(sorted((*cores, *added)))

    def give_back(self, cores: Iterable[int]) -> None:
        cores = set(cores)
        if cores & self.free:
            raise RuntimeError(f"cores {sorted(cores & self.free)} released twice")
        self.free |= cores

    def numa_of(self, cores: Iterable[int]) -> list[int]:
        """Indices of the NUMA nodes ``cores`` fall in (one index when the pinning kept them together)."""
        return sorted({self._group[core] for core in cores})
