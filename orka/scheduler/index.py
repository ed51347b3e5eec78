"""A per-snapshot index that lets a decision look at a handful of nodes instead of all of them.

Built once per snapshot (O(n log n)) and shared by every decision on that snapshot. Nodes that
the request-independent filters (ready, schedulable) reject are left out; the rest are grouped
into buckets of one driver set and one allocatable shape, each sorted by how used its nodes are
(u = cpu_used/cpu_allocatable + mem_used/mem_allocatable). Within a bucket both built-in scorers
are a monotone function of u for a node holding no instance of the request's workload:

    spread  = 1 - (u + cpu/cpu_alloc + mem/mem_alloc) / 2       (best: smallest u)
    binpack =     (u + cpu/cpu_alloc + mem/mem_alloc) / 2       (best: largest u that fits)

so the best nodes of all buckets come out of a k-way merge. Every node the merge yields is still
checked by the real filters and scored by the real scorer; the index only decides which nodes
are worth that. Whenever it cannot prove it found the true best (too few feasible nodes, a
spread request whose workload already sits on the candidates, unusual capacities), the caller
falls back to the exhaustive pipeline, so rankings are the same either way.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from orka.models import NodeState
from orka.scheduler.snapshot import NodeView, Snapshot

# Approximate keys are exact up to float rounding (~1e-16); anything within this of the k-th
# best is collected too and ordered by its exact score, so rounding can never change a ranking.
EPSILON = 1e-9


@dataclass(slots=True)
class Bucket:
    drivers: frozenset[str]
    cpu_alloc: int
    mem_alloc: int
    nodes: list[NodeView] = field(default_factory=list)
    # u of each node, ascending, parallel to `nodes` (for bisect).
    used: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SnapshotIndex:
    buckets: list[Bucket]
    # Eligible nodes the buckets cannot order (an allocatable of zero): always checked in full.
    odd: list[NodeView]

    @classmethod
    def build(cls, snapshot: Snapshot) -> SnapshotIndex:
        groups: dict[tuple[frozenset[str], int, int], list[tuple[float, NodeView]]] = {}
        odd: list[NodeView] = []
        for node in snapshot.nodes:
            # Conservative: only what ReadyFilter and SchedulableFilter reject for any request.
            if node.state is not NodeState.READY or not node.schedulable:
                continue
            ca, ma = node.cpu_allocatable, node.mem_allocatable
            if ca <= 0 or ma <= 0:
                odd.append(node)
                continue
            u = node.cpu_used / ca + node.mem_used / ma
            groups.setdefault((node.drivers, ca, ma), []).append((u, node))
        buckets = []
        for (drivers, ca, ma), items in groups.items():
            items.sort(key=lambda item: (item[0], item[1].name))
            buckets.append(Bucket(drivers, ca, ma, [n for _, n in items], [u for u, _ in items]))
        return cls(buckets, odd)


def walk_spread(bucket: Bucket, extra: float) -> Iterator[tuple[float, NodeView]]:
    """Nodes of one bucket, best approximate spread score first: (-score, node)."""
    half = 0.5 * extra - 1.0
    for u, node in zip(bucket.used, bucket.nodes, strict=True):
        yield (0.5 * u + half, node)


def walk_binpack(bucket: Bucket, extra: float) -> Iterator[tuple[float, NodeView]]:
    """Nodes of one bucket that may fit, best approximate binpack score first: (-score, node).

    A node with u above 2 - extra cannot fit (one of its two fractions would exceed 1), so the
    walk starts below that and goes down.
    """
    start = bisect.bisect_right(bucket.used, 2.0 - extra + EPSILON)
    used, nodes = bucket.used, bucket.nodes
    for i in range(start - 1, -1, -1):
        yield (-0.5 * (used[i] + extra), nodes[i])


def updated(index: SnapshotIndex, old: list[NodeView], new: list[NodeView]) -> SnapshotIndex:
    """The index of a snapshot that differs from `index`'s by replacing `old` with `new` views.

    Copy-on-write per touched bucket, so the previous snapshot's index stays valid (snapshots
    are immutable and a ranking may still be reading the old one).
    """
    buckets = list(index.buckets)
    odd = index.odd
    copied: set[int] = set()
    slot = {(b.drivers, b.cpu_alloc, b.mem_alloc): i for i, b in enumerate(buckets)}

    def bucket_for(node: NodeView, create: bool) -> Bucket | None:
        key = (node.drivers, node.cpu_allocatable, node.mem_allocatable)
        i = slot.get(key)
        if i is None:
            if not create:
                return None
            buckets.append(Bucket(*key))
            i = slot[key] = len(buckets) - 1
            copied.add(i)
        elif i not in copied:
            b = buckets[i]
            buckets[i] = Bucket(b.drivers, b.cpu_alloc, b.mem_alloc, list(b.nodes), list(b.used))
            copied.add(i)
        return buckets[i]

    def eligible(node: NodeView) -> bool:
        return node.state is NodeState.READY and node.schedulable

    for node in old:
        if not eligible(node):
            continue
        if node.cpu_allocatable <= 0 or node.mem_allocatable <= 0:
            odd = [n for n in odd if n is not node]
            continue
        b = bucket_for(node, create=False)
        if b is None:
            continue
        u = node.cpu_used / node.cpu_allocatable + node.mem_used / node.mem_allocatable
        i = bisect.bisect_left(b.used, u)
        while i < len(b.nodes) and b.nodes[i] is not node:
            i += 1
        if i < len(b.nodes):
            del b.nodes[i]
            del b.used[i]
    for node in new:
        if not eligible(node):
            continue
        if node.cpu_allocatable <= 0 or node.mem_allocatable <= 0:
            odd = [*odd, node]
            continue
        b = bucket_for(node, create=True)
        assert b is not None
        u = node.cpu_used / node.cpu_allocatable + node.mem_used / node.mem_allocatable
        lo = bisect.bisect_left(b.used, u)
        hi = bisect.bisect_right(b.used, u)
        # Same (u, name) order as build(), so ties walk the same way.
        while lo < hi and b.nodes[lo].name < node.name:
            lo += 1
        b.nodes.insert(lo, node)
        b.used.insert(lo, u)
    return SnapshotIndex([b for b in buckets if b.nodes], odd)
