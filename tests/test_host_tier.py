"""The host-memory tier's decisions (``managers/gpu/host_tier.py``): what a load drops, and what prefetch loads."""

from __future__ import annotations

import pytest

from managers.gpu.host_tier import CopyState, HostTier, HostTierFull


def tier_with(in_host: list[str], budget_mb: int = 300, size_mb: int = 100,
              on_disk: tuple[str, ...] = ("d", "e")) -> HostTier:
    """A tier whose ``in_host`` copies were loaded in that order (least recently used first)."""
    tier = HostTier(budget_mb, {name: size_mb for name in [*in_host, *on_disk]})
    for name in in_host:
        assert tier.plan_load(name) == []
        tier.loaded(name)
    return tier


def states(tier: HostTier) -> dict[str, str]:
    return {name: copy.state.value for name, copy in tier.copies.items()}


def test_a_load_drops_the_least_recently_used_copy_that_nothing_reads() -> None:
    tier = tier_with(["a", "b", "c"])
    tier.pin("a")  # a restore reads a: it is used last now, and cannot go
    victims = tier.plan_load("d")
    assert [v.service for v in victims] == ["b"]
    assert states(tier) == {"a": "host", "b": "disk", "c": "host", "d": "loading", "e": "disk"}
    assert tier.used_mb == 300
    tier.loaded("d")
    assert tier.copies["d"].state is CopyState.HOST and tier.copies["d"].pins == 0


def test_a_load_drops_spared_copies_only_after_every_other() -> None:
    tier = tier_with(["a", "b", "c"])
    assert [v.service for v in tier.plan_load("d", spare=["a", "b"])] == ["c"]
    assert [v.service for v in tier.plan_load("e", spare=["a", "b"])] == ["a"]  # nothing else left: LRU spared


def test_a_load_that_only_pinned_or_kept_copies_could_make_room_for_is_refused_naming_them() -> None:
    tier = tier_with(["a", "b", "c"])
    tier.pin("a")
    tier.pin("b")
    with pytest.raises(HostTierFull, match=r"d needs 100 MiB .* \['a', 'b', 'c'\]"):
        tier.plan_load("d", keep=["c"])
    assert states(tier)["d"] == "disk" and tier.used_mb == 300  # nothing booked or dropped


def test_a_failed_load_leaves_the_copy_on_disk_and_its_room_free() -> None:
    tier = tier_with(["a", "b"])
    tier.plan_load("d")
    tier.load_failed("d")
    assert states(tier)["d"] == "disk" and tier.copies["d"].pins == 0 and tier.used_mb == 200


def test_loading_and_holding() -> None:
    tier = tier_with(["a"])
    assert tier.holds("a") and not tier.holds("d") and not tier.loading
    tier.plan_load("d")
    assert tier.holds("d") and tier.loading
