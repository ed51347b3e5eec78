"""The controller's view of the store: every object cached in memory, every write a CAS commit.

All writes go through `mutate`, which runs the caller's planning function and the commit under
one lock, so a plan always starts from the latest state and its compare-and-swap cannot lose
to this process; it can only lose to another writer on the same store, which is then an error.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from orka.models import Instance, Node, Workload
from orka.store.base import Create, Delete, Op, Store, Update

Kind = Literal["workloads", "instances", "nodes"]
Listener = Callable[[str, "Change"], None]


@dataclass(frozen=True, slots=True)
class Change:
    kind: Kind
    name: str
    value: BaseModel | None  # None deletes
    create: bool = False


class Repo:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.workloads: dict[str, Workload] = {}
        self.instances: dict[str, Instance] = {}
        self.nodes: dict[str, Node] = {}
        self.by_workload: dict[str, set[str]] = defaultdict(set)
        self._revisions: dict[tuple[str, str], int] = {}
        self._lock = asyncio.Lock()
        self.listeners: list[Callable[[Change, BaseModel | None], None]] = []
        self.writes = 0

    async def load(self) -> None:
        for item in await self.store.list("workloads"):
            self.workloads[item.name] = Workload.model_validate(item.value)
            self._revisions[("workloads", item.name)] = item.revision
        for item in await self.store.list("instances"):
            inst = Instance.model_validate(item.value)
            self.instances[item.name] = inst
            self.by_workload[inst.workload].add(item.name)
            self._revisions[("instances", item.name)] = item.revision
        for item in await self.store.list("nodes"):
            self.nodes[item.name] = Node.model_validate(item.value)
            self._revisions[("nodes", item.name)] = item.revision

    def instances_of(self, workload: str) -> list[Instance]:
        return [
            self.instances[n] for n in self.by_workload.get(workload, ()) if n in self.instances
        ]

    def _table(self, kind: Kind) -> dict[str, BaseModel]:
        return getattr(self, kind)  # type: ignore[no-any-return]

    async def mutate(self, plan: Callable[[], list[Change]]) -> list[Change]:
        async with self._lock:
            changes = plan()
            if changes:
                await self._commit(changes)
            return changes

    async def _commit(self, changes: list[Change]) -> None:
        # The last change of a key wins, so plans may touch an object twice.
        merged: dict[tuple[str, str], Change] = {}
        for c in changes:
            key = (c.kind, c.name)
            prev = merged.get(key)
            if prev is not None and prev.create:
                c = Change(c.kind, c.name, c.value, create=c.value is not None)
                if c.value is None:
                    del merged[key]
                    continue
            merged[key] = c
        ops: list[Op] = []
        for (kind, name), c in merged.items():
            rev = self._revisions.get((kind, name))
            if c.value is None:
                if rev is not None:
                    ops.append(Delete(kind, name, expected_revision=rev))
            elif c.create or rev is None:
                ops.append(Create(kind, name, c.value.model_dump(mode="json")))
            else:
                ops.append(Update(kind, name, c.value.model_dump(mode="json"), rev))
        if not ops:
            return
        revisions = await self.store.commit(ops)
        self.writes += 1
        for op, rev in zip(ops, revisions, strict=True):
            key = (op.kind, op.name)
            c = merged[key]
            table = self._table(c.kind)
            old = table.get(op.name)
            if isinstance(op, Delete):
                table.pop(op.name, None)
                self._revisions.pop(key, None)
                if c.kind == "instances" and isinstance(old, Instance):
                    self.by_workload[old.workload].discard(op.name)
                    if not self.by_workload[old.workload]:
                        del self.by_workload[old.workload]
            else:
                assert c.value is not None
                table[op.name] = c.value
                self._revisions[key] = rev
                if isinstance(c.value, Instance):
                    self.by_workload[c.value.workload].add(op.name)
            for listener in self.listeners:
                listener(c, old)

    def touch(self, model: BaseModel) -> None:
        """Refresh a cached object without a write (soft fields such as node usage)."""
        if isinstance(model, Node) and model.name in self.nodes:
            self.nodes[model.name] = model


def now() -> float:
    return time.time()
