"""The controller's view of the store: every object cached in memory, every write a CAS commit.

All writes go through `mutate`, which runs the caller's planning function and the commit under
one lock, so a plan always starts from the latest state and its compare-and-swap cannot lose
to this process; it can only lose to another writer on the same store (a controller that led
before us, or leads after us). Such a loss means the cache is stale: it is reloaded from the
store before the error is raised, so the next plan starts from the truth instead of failing the
same compare again and again.

While leading on a store with an election, every transaction also carries `fence`, the
leader's `Require` on its own election key: a controller whose lease ran out while it was
paused or cut off lands nothing, even where its successor has not touched the keys it writes.
A failed fence (`Fenced`) is not reloaded and retried like a lost compare: the repo stops
writing and tells `on_fenced`, so the controller steps down at once.

A commit is split into transactions of at most `MAX_TXN_OPS` ops, etcd's default per-txn limit,
so the controller works against an etcd run with default flags. Each op is still a CAS on its
own key, which is what keeps an instance from being bound twice; what a split gives up is only
all-or-nothing across chunks, and every plan is written to converge when re-run from a partly
applied state (the reconciler plans again from whatever landed). Each chunk is a commit with
its own store revision (and its own copy of the fence); `revision` is the last one applied (or
the store's at load), which is what a list answers with and what a watch resumes from.

Each table has a sorted index of its objects' immutable keys, kept as they are written, so a
list page is a range walk, not a sort of everything.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from sortedcontainers import SortedList

from orka.errors import AlreadyExists, Conflict, NotFound, NotLeader
from orka.models import Class, Instance, Node, Volume, Workload
from orka.store.base import Create, Delete, Fenced, JsonText, Op, Require, Store, Update

Kind = Literal["workloads", "instances", "nodes", "classes", "volumes"]

# etcd's default --max-txn-ops; larger commits are split into several transactions.
MAX_TXN_OPS = 128


def instance_key(inst: Instance) -> tuple[str, float, str]:
    """Where an instance sorts in lists: by workload, then age. Every part is immutable."""
    return (inst.workload, inst.created_at, inst.name)


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
        self.classes: dict[str, Class] = {}
        self.volumes: dict[str, Volume] = {}
        self.by_workload: dict[str, set[str]] = defaultdict(set)
        # node -> the names of the instances bound to it (a node's re-registration looks up
        # its instances; after a scheduler failover that is every node at once).
        self.by_node: dict[str, set[str]] = defaultdict(set)
        self._revisions: dict[tuple[str, str], int] = {}
        # The sort keys of every object, for paged lists: (name,) for all but instances,
        # instance_key for instances.
        self.order: dict[Kind, SortedList] = _orders({}, {}, {}, {}, {})
        # The store revision this cache reflects: the store's at load, then each commit's.
        self.revision = 0
        # Called with the new revision after a load: what was streamed before no longer
        # lines up with the cache (another writer's changes came in without events).
        self.on_reload: list[Callable[[int], None]] = []
        self._lock = asyncio.Lock()
        self.listeners: list[Callable[[Change, BaseModel | None], None]] = []
        self.writes = 0
        self.reloads = 0
        # Only a leading controller writes; a follower's repo refuses before touching the store.
        self.writable = True
        self.max_txn_ops = MAX_TXN_OPS
        # The leader's condition on its own election key, added to every transaction while it
        # leads (None: a single-node store, where the SQLite writer lock does that job).
        self.fence: Require | None = None
        # Called once a commit failed its fence; the repo has stopped writing by then.
        self.on_fenced: list[Callable[[Fenced], None]] = []

    async def load(self) -> None:
        """Replace every cache with the store's content (a new term, or a lost CAS)."""
        async with self._lock:
            await self._load()

    async def _load(self) -> None:
        workloads: dict[str, Workload] = {}
        instances: dict[str, Instance] = {}
        nodes: dict[str, Node] = {}
        classes: dict[str, Class] = {}
        volumes: dict[str, Volume] = {}
        by_workload: dict[str, set[str]] = defaultdict(set)
        by_node: dict[str, set[str]] = defaultdict(set)
        revisions: dict[tuple[str, str], int] = {}
        # Read first: the lists that follow are at least this new.
        at = await self.store.revision()
        for item in await self.store.list("workloads"):
            workloads[item.name] = Workload.model_validate(item.value)
            revisions[("workloads", item.name)] = item.revision
        for item in await self.store.list("instances"):
            inst = Instance.model_validate(item.value)
            instances[item.name] = inst
            by_workload[inst.workload].add(item.name)
            if inst.node:
                by_node[inst.node].add(item.name)
            revisions[("instances", item.name)] = item.revision
        for item in await self.store.list("nodes"):
            nodes[item.name] = Node.model_validate(item.value)
            revisions[("nodes", item.name)] = item.revision
        for item in await self.store.list("classes"):
            classes[item.name] = Class.model_validate(item.value)
            revisions[("classes", item.name)] = item.revision
        for item in await self.store.list("volumes"):
            volumes[item.name] = Volume.model_validate(item.value)
            revisions[("volumes", item.name)] = item.revision
        # Swapped in whole, not cleared and refilled: a caller iterating the old tables across
        # an await keeps a consistent (if old) view instead of a "changed size" error.
        self.workloads, self.instances, self.nodes = workloads, instances, nodes
        self.classes, self.volumes = classes, volumes
        self.by_workload, self.by_node, self._revisions = by_workload, by_node, revisions
        self.order = _orders(workloads, instances, nodes, classes, volumes)
        self.revision = max(at, *revisions.values()) if revisions else at
        for hook in self.on_reload:
            hook(self.revision)

    def reset(self) -> None:
        """Drop every cache: a follower must not answer from, or plan on, what it once led."""
        self.workloads, self.instances, self.nodes = {}, {}, {}
        self.classes, self.volumes = {}, {}
        self.by_workload, self.by_node, self._revisions = defaultdict(set), defaultdict(set), {}
        self.order = _orders({}, {}, {}, {}, {})
        self.revision = 0

    def revision_of(self, kind: Kind, name: str) -> int:
        """The store revision of the object's last write (0: not stored)."""
        return self._revisions.get((kind, name), 0)

    def instances_of(self, workload: str) -> list[Instance]:
        return self._indexed(self.by_workload, workload)

    def instances_on(self, node: str) -> list[Instance]:
        """The instances bound to `node`, whatever their phase."""
        return self._indexed(self.by_node, node)

    def _indexed(self, index: dict[str, set[str]], key: str) -> list[Instance]:
        return [self.instances[n] for n in index.get(key, ()) if n in self.instances]

    def _table(self, kind: Kind) -> dict[str, BaseModel]:
        return getattr(self, kind)  # type: ignore[no-any-return]

    async def mutate(self, plan: Callable[[], list[Change]]) -> list[Change]:
        async with self._lock:
            if not self.writable:
                raise NotLeader("not the leader: this controller does not write")
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
                ops.append(Create(kind, name, JsonText(c.value.model_dump_json())))
            else:
                ops.append(Update(kind, name, JsonText(c.value.model_dump_json()), rev))
        fence = self.fence
        # The fence is one more compare in each transaction: it counts against etcd's limit.
        size = self.max_txn_ops - (fence is not None)
        for lo in range(0, len(ops), size):
            chunk = ops[lo : lo + size]
            try:
                if fence is None:
                    revisions = await self.store.commit(chunk)
                else:
                    revisions = (await self.store.commit([fence, *chunk]))[1:]
            except Fenced as err:
                # Someone else leads: reloading and retrying would only fail again, and this
                # controller must not plan on anything any more.
                self.writable = False
                for hook in self.on_fenced:
                    hook(err)
                raise
            except (Conflict, AlreadyExists, NotFound):
                # Another writer got there first: our cache is stale. Chunks already applied
                # are in the cache and the store alike; reload so the caller re-plans on truth.
                self.reloads += 1
                await self._load()
                raise
            self.writes += 1
            # Every op of a commit carries the commit's revision, but a delete reports 0: a
            # chunk of deletes only has to ask.
            self.revision = max(revisions) or await self.store.revision()
            self._applied(chunk, revisions, merged)

    def _applied(
        self, ops: list[Op], revisions: list[int], merged: dict[tuple[str, str], Change]
    ) -> None:
        for op, rev in zip(ops, revisions, strict=True):
            key = (op.kind, op.name)
            c = merged[key]
            table = self._table(c.kind)
            old = table.get(op.name)
            if isinstance(op, Delete):
                table.pop(op.name, None)
                self._revisions.pop(key, None)
                if old is not None:
                    self.order[c.kind].discard(_key(old))
                if c.kind == "instances" and isinstance(old, Instance):
                    _unindex(self.by_workload, old.workload, op.name)
                    _unindex(self.by_node, old.node, op.name)
            else:
                assert c.value is not None
                table[op.name] = c.value
                self._revisions[key] = rev
                # Sort keys are made of immutable fields, so mostly only a new object adds
                # one; an instance written over by another of its name moves, or a list page
                # would hand out the new instance at the old one's place.
                if old is None:
                    self.order[c.kind].add(_key(c.value))
                elif _moved(old, c.value):
                    self.order[c.kind].discard(_key(old))
                    self.order[c.kind].add(_key(c.value))
                if isinstance(c.value, Instance):
                    self.by_workload[c.value.workload].add(op.name)
                    if isinstance(old, Instance) and old.node != c.value.node:
                        _unindex(self.by_node, old.node, op.name)
                    if c.value.node:
                        self.by_node[c.value.node].add(op.name)
            for listener in self.listeners:
                listener(c, old)

    def touch(self, model: BaseModel) -> None:
        """Refresh a cached object without a write (soft fields such as node usage)."""
        if isinstance(model, Node) and model.name in self.nodes:
            self.nodes[model.name] = model


def _unindex(index: dict[str, set[str]], key: str, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]


def _moved(old: BaseModel, new: BaseModel) -> bool:
    """Whether an update changes the object's sort key (an instance's age; a name is the key
    of the table it is written under)."""
    return isinstance(old, Instance) and old.created_at != new.created_at  # type: ignore[attr-defined]


def _key(value: BaseModel) -> tuple[object, ...]:
    if isinstance(value, Instance):
        return instance_key(value)
    return (value.name,)  # type: ignore[attr-defined]


def _orders(
    workloads: dict[str, Workload],
    instances: dict[str, Instance],
    nodes: dict[str, Node],
    classes: dict[str, Class],
    volumes: dict[str, Volume],
) -> dict[Kind, SortedList]:
    return {
        "workloads": SortedList((n,) for n in workloads),
        "instances": SortedList(instance_key(i) for i in instances.values()),
        "nodes": SortedList((n,) for n in nodes),
        "classes": SortedList((n,) for n in classes),
        "volumes": SortedList((n,) for n in volumes),
    }
