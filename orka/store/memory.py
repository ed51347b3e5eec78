"""In-process store for unit tests and benchmarks; forgets everything on close."""

from __future__ import annotations

import time
from collections.abc import Sequence

from orka import metrics
from orka.store.base import (
    Delete,
    Item,
    Op,
    Require,
    Store,
    check_precondition,
    decode_value,
    prepare_batch,
    requirements_first,
    validate_key,
    validate_kind,
    writes_nothing,
)


class MemoryStore(Store):
    def __init__(self) -> None:
        # Values are kept as JSON text so callers can never mutate stored state through a returned
        # dict, and so this backend accepts and returns exactly what the durable ones do.
        self._data: dict[str, dict[str, tuple[int, str]]] = {}
        self._revision = 0
        self._open = False

    async def open(self) -> None:
        self._open = True

    async def close(self) -> None:
        self._open = False
        self._data.clear()
        self._revision = 0

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("store is not open")

    async def get(self, kind: str, name: str) -> Item | None:
        self._check_open()
        validate_key(kind, name)
        entry = self._data.get(kind, {}).get(name)
        if entry is None:
            return None
        return Item(kind, name, entry[0], decode_value(entry[1]))

    async def list(self, kind: str, prefix: str = "") -> list[Item]:
        self._check_open()
        validate_kind(kind)
        items = self._data.get(kind, {})
        return [
            Item(kind, name, revision, decode_value(text))
            for name, (revision, text) in sorted(items.items())
            if name.startswith(prefix)
        ]

    async def commit(self, ops: Sequence[Op]) -> list[int]:
        self._check_open()
        prepared = prepare_batch(ops)
        if not prepared:
            return []
        # No await below, so the check-then-apply cannot interleave with another commit: the
        # event loop itself is the lock. Every check runs before any write, which is equivalent to
        # sequential application because a batch never names a key twice.
        for op in requirements_first([p.op for p in prepared]):
            current = self._data.get(op.kind, {}).get(op.name)
            check_precondition(op, None if current is None else current[0])
        if writes_nothing(prepared):
            return [0] * len(prepared)
        start = time.perf_counter()
        self._revision += 1
        revisions: list[int] = []
        for p in prepared:
            op = p.op
            if isinstance(op, Require):
                revisions.append(0)
            elif isinstance(op, Delete):
                bucket = self._data[op.kind]
                del bucket[op.name]
                if not bucket:
                    del self._data[op.kind]
                revisions.append(0)
            else:
                assert p.encoded is not None
                self._data.setdefault(op.kind, {})[op.name] = (self._revision, p.encoded)
                revisions.append(self._revision)
        metrics.store_committed("memory", start)
        return revisions

    async def revision(self) -> int:
        self._check_open()
        return self._revision
