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

    def __init__(
        self,
        make: Callable[[K], V],
        size: int = 1024,
        weigh: Callable[[V], int] | None = None,
        max_weight: int = 0,
    ) -> None:
        self.make = make
        self.size = size
        # With `weigh`, the table is also dropped when the values' weights (bytes, say) would
        # pass `max_weight`: 1,024 specs of 1 MiB each are a lot to keep alive.
        self.weigh = weigh
        self.max_weight = max_weight
        self.weight = 0
        self._table: dict[int, tuple[K, V]] = {}

    def __call__(self, key: K) -> V:
        hit = self._table.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        value = self.make(key)
        weight = self.weigh(value) if self.weigh is not None else 0
        if len(self._table) >= self.size or (
            self.weigh is not None and self.weight + weight > self.max_weight
        ):
            self._table.clear()
            self.weight = 0
        self._table[id(key)] = (key, value)
        self.weight += weight
        return value
