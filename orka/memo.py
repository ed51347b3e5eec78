"""Values derived from frozen models, computed once per model object."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByIdentity(Generic[K, V]):
    """`make(key)` remembered per key object, for keys that never change (frozen models) and
    may not be hashable. Holding each key keeps its id from being reused while it is here;
    the whole table is dropped when it reaches `size`, which costs one recomputation each."""

    def __init__(self, make: Callable[[K], V], size: int = 1024) -> None:
        self.make = make
        self.size = size
        self._table: dict[int, tuple[K, V]] = {}

    def __call__(self, key: K) -> V:
        hit = self._table.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        if len(self._table) >= self.size:
            self._table.clear()
        value = self.make(key)
        self._table[id(key)] = (key, value)
        return value
