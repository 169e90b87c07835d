"""The broker's collector policy: what a full collection leaves is frozen, and unfrozen again once it has grown."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from tangram.frozen_survivors import FrozenSurvivors


class Node:
    """A container the collector tracks, able to join a cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """Each test starts and ends with nothing frozen (the collector's state is the process's)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


async def test_a_full_collection_on_the_loop_freezes_what_it_left() -> None:
    survivors = FrozenSurvivors(asyncio.get_running_loop())
    survivors.start()
    try:
        kept = [Node() for _ in range(1_000)]
        gc.collect()
        assert gc.get_freeze_count() == 0  # the freeze runs on the loop, after the collection
        await asyncio.sleep(0)
        assert survivors.freezes == 1
        assert gc.get_freeze_count() >= len(kept)
    finally:
        survivors.stop()
    gc.collect()
    await asyncio.sleep(0)
    assert survivors.freezes == 1  # stopped: no longer called


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_a_cycle_among_frozen_records_is_collected_once_the_frozen_set_has_doubled(
        loop: asyncio.AbstractEventLoop) -> None:
    survivors = FrozenSurvivors(loop, growth=2.0)
    first, second = Node(), Node()
    first.other, second.other = second, first
    dead = weakref.ref(first)
    survivors.after_full_collection()  # the complete scan: its survivors are frozen, the cycle with them
    scanned = gc.get_freeze_count()
    del first, second
    gc.collect()
    assert dead() is not None  # frozen: no collection looks at it

    newer = [Node() for _ in range(2 * scanned)]
    survivors.after_full_collection()  # not grown past twice the scan yet: freezes the newer ones too
    assert survivors.rescans == 0 and gc.get_freeze_count() > 2 * scanned
    survivors.after_full_collection()  # grown past it: everything goes back to the collector
    assert survivors.rescans == 1 and gc.get_freeze_count() == 0
    gc.collect()
    assert dead() is None
    survivors.after_full_collection()  # the next complete scan starts the count again
    assert survivors.freezes == 3 and gc.get_freeze_count() >= len(newer)
