"""A per-snapshot index that lets a decision look at a handful of nodes instead of all of them.

Built once per snapshot (O(n log n)) and shared by every decision on that snapshot. Nodes that
the request-independent filters (ready, schedulable) reject are left out; the rest are grouped
into buckets of one driver set and one allocatable shape, each sorted by how used its nodes are
(u = cpu_used/cpu_allocatable + mem_used/mem_allocatable); the nodes of a bucket with the same
cpu_used and mem_used form one group, ordered by name. Within a bucket both built-in scorers
are a monotone function of u for a node holding no instance of the request's workload:

    spread  = 1 - (u + cpu/cpu_alloc + mem/mem_alloc) / 2       (best: smallest u)
    binpack =     (u + cpu/cpu_alloc + mem/mem_alloc) / 2       (best: largest u that fits)

so the best groups of all buckets come out of a k-way merge, and within a group (equal scores)
the first nodes by name are the best. A scorer opts into this by carrying an `IndexedWalk`: its
walk of one bucket, best first. Every node the merge yields is still checked by the real filters
and scored by the real scorer; the index only decides which nodes are worth that. Whenever it
cannot prove it found the true best (too few feasible nodes, a spread request whose workload
already sits on the candidates, unusual capacities), the indexed stage (orka.scheduler.indexed)
leaves the decision to the exhaustive one, so rankings are the same either way.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from orka import fit
from orka.scheduler.snapshot import NodeView

# Approximate keys are exact up to float rounding (~1e-16); anything within this of the k-th
# best is collected too and ordered by its exact score, so rounding can never change a ranking.
EPSILON = 1e-9


@dataclass(slots=True)
class Group:
    """The nodes of one bucket that have the same cpu_used and mem_used, by name.

    Each built-in scorer gives all of them the same score for a request (for spread: those not
    holding the request's workload), so ties among them go by name alone and a decision never
    needs more than `limit` feasible nodes of one group. In a fleet filled evenly most nodes
    share a few groups, so this is what keeps a decision from walking every tied node.
    """

    cpu_used: int
    mem_used: int
    nodes: list[NodeView] = field(default_factory=list)


@dataclass(slots=True)
class Bucket:
    drivers: frozenset[str]
    cpu_alloc: int
    mem_alloc: int
    # Ascending by (u, cpu_used, mem_used).
    groups: list[Group] = field(default_factory=list)
    # u of each group, ascending, parallel to `groups` (for bisect).
    used: list[float] = field(default_factory=list)

    @property
    def nodes(self) -> list[NodeView]:
        """Every node of the bucket, in walk order (u, then cpu_used, mem_used, then name)."""
        return [n for g in self.groups for n in g.nodes]


@dataclass(slots=True)
class SnapshotIndex:
    buckets: list[Bucket]
    # Eligible nodes the buckets cannot order (an allocatable of zero): always checked in full.
    odd: list[NodeView]

    @classmethod
    def build(cls, nodes: Iterable[NodeView]) -> SnapshotIndex:
        groups: dict[tuple[frozenset[str], int, int], dict[tuple[int, int], list[NodeView]]] = {}
        odd: list[NodeView] = []
        for node in nodes:
            # Only what the rule rejects whatever the request: not READY, cordoned or draining.
            if fit.availability(node) is not None:
                continue
            ca, ma = node.cpu_allocatable, node.mem_allocatable
            if ca <= 0 or ma <= 0:
                odd.append(node)
                continue
            by_used = groups.setdefault((node.drivers, ca, ma), {})
            by_used.setdefault((node.cpu_used, node.mem_used), []).append(node)
        buckets = []
        for (drivers, ca, ma), by_used in groups.items():
            keyed = sorted((_u(cu, mu, ca, ma), cu, mu) for cu, mu in by_used)
            b = Bucket(drivers, ca, ma)
            for u, cu, mu in keyed:
                members = by_used[(cu, mu)]
                members.sort(key=_name)
                b.groups.append(Group(cu, mu, members))
                b.used.append(u)
            buckets.append(b)
        return cls(buckets, odd)


@dataclass(frozen=True, slots=True)
class IndexedWalk:
    """A scorer's opt-in to the indexed stage: how to walk one bucket best first.

    `walk(bucket, extra)` (extra: the request's cpu/cpu_alloc + mem/mem_alloc for the bucket)
    yields (key, group) by ascending key, where key is minus the scorer's score, up to float
    rounding, of every node of the group (except, with `skips_holders`, nodes that hold the
    request's workload: those score below every node that holds none, by more than the
    scorer's whole range, so the stage leaves them out and defers when too few others fit).
    """

    walk: Callable[[Bucket, float], Iterator[tuple[float, Group]]]
    skips_holders: bool = False


def _u(cpu_used: int, mem_used: int, cpu_alloc: int, mem_alloc: int) -> float:
    return cpu_used / cpu_alloc + mem_used / mem_alloc


def _name(node: NodeView) -> str:
    return node.name


def walk_spread(bucket: Bucket, extra: float) -> Iterator[tuple[float, Group]]:
    """Groups of one bucket, best approximate spread score first: (-score, group)."""
    half = 0.5 * extra - 1.0
    for u, group in zip(bucket.used, bucket.groups, strict=True):
        yield (0.5 * u + half, group)


def walk_binpack(bucket: Bucket, extra: float) -> Iterator[tuple[float, Group]]:
    """Groups of one bucket that may fit, best approximate binpack score first: (-score, group).

    A node with u above `fit.most_used_that_fits(extra)` fails the rule's resource check, so the
    walk starts below that and goes down.
    """
    start = bisect.bisect_right(bucket.used, fit.most_used_that_fits(extra) + EPSILON)
    used, groups = bucket.used, bucket.groups
    for i in range(start - 1, -1, -1):
        yield (-0.5 * (used[i] + extra), groups[i])


def updated(index: SnapshotIndex, old: list[NodeView], new: list[NodeView]) -> SnapshotIndex:
    """The index of a snapshot that differs from `index`'s by replacing `old` with `new` views.

    Copy-on-write per touched bucket and group, so the previous snapshot's index stays valid
    (snapshots are immutable and a ranking may still be reading the old one).
    """
    buckets = list(index.buckets)
    odd = index.odd
    copied: set[int] = set()
    # Groups created by this call (by id), which it may change in place.
    fresh: set[int] = set()
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
            buckets[i] = Bucket(b.drivers, b.cpu_alloc, b.mem_alloc, list(b.groups), list(b.used))
            copied.add(i)
        return buckets[i]

    def eligible(node: NodeView) -> bool:
        return fit.availability(node) is None

    for node in old:
        if not eligible(node):
            continue
        if node.cpu_allocatable <= 0 or node.mem_allocatable <= 0:
            odd = [n for n in odd if n is not node]
            continue
        b = bucket_for(node, create=False)
        if b is None:
            continue
        cu, mu = node.cpu_used, node.mem_used
        u = _u(cu, mu, b.cpu_alloc, b.mem_alloc)
        i = bisect.bisect_left(b.used, u)
        groups = b.groups
        while i < len(groups) and not (groups[i].cpu_used == cu and groups[i].mem_used == mu):
            if b.used[i] != u:
                i = len(groups)
                break
            i += 1
        if i == len(groups):
            continue
        g = groups[i]
        j = bisect.bisect_left(g.nodes, node.name, key=_name)
        if j == len(g.nodes) or g.nodes[j] is not node:
            continue
        if len(g.nodes) == 1:
            del groups[i]
            del b.used[i]
            continue
        if id(g) not in fresh:
            g = groups[i] = Group(cu, mu, list(g.nodes))
            fresh.add(id(g))
        del g.nodes[j]
    for node in new:
        if not eligible(node):
            continue
        if node.cpu_allocatable <= 0 or node.mem_allocatable <= 0:
            odd = [*odd, node]
            continue
        b = bucket_for(node, create=True)
        assert b is not None
        cu, mu = node.cpu_used, node.mem_used
        u = _u(cu, mu, b.cpu_alloc, b.mem_alloc)
        i = bisect.bisect_left(b.used, u)
        groups = b.groups
        # Same (u, cpu_used, mem_used) order as build().
        while (
            i < len(groups)
            and b.used[i] == u
            and (groups[i].cpu_used, groups[i].mem_used) < (cu, mu)
        ):
            i += 1
        if (
            i < len(groups)
            and b.used[i] == u
            and groups[i].cpu_used == cu
            and groups[i].mem_used == mu
        ):
            g = groups[i]
            if id(g) not in fresh:
                g = groups[i] = Group(cu, mu, list(g.nodes))
                fresh.add(id(g))
            bisect.insort(g.nodes, node, key=_name)
        else:
            g = Group(cu, mu, [node])
            fresh.add(id(g))
            groups.insert(i, g)
            b.used.insert(i, u)
    return SnapshotIndex([b for b in buckets if b.groups], odd)
