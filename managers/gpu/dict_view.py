"""A read-only mapping over a dict its owner keeps changing: helpers read the GPU manager's services and nodes
through it, only the owner writes."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class DictView(Mapping[K, V]):
    def __init__(self, items: dict[K, V]) -> None:
        self._items = items

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> KeysView[K]:
        return self._items.keys()

    def values(self) -> ValuesView[V]:
        return self._items.values()

    def items(self) -> ItemsView[K, V]:
        return self._items.items()
