"""The index-driven ranking must equal the exhaustive one, on varied random snapshots."""

from __future__ import annotations

import random

import pytest

from bench.bench_decisions import build_requests, build_snapshot
from orka.models import NodeState, Resources, WorkloadKind
from orka.scheduler.filters import FILTERS
from orka.scheduler.index import SnapshotIndex, updated
from orka.scheduler.indexed import IndexedStage
from orka.scheduler.pipeline import POLICIES, Decision, Pipeline, PipelineConfig
from orka.scheduler.registry import Registry
from orka.scheduler.snapshot import NodeView, Snapshot
from tests.unit.scheduler.builders import request


def _exhaustive(pipeline: Pipeline, req, snap: Snapshot, limit: int):  # type: ignore[no-untyped-def]
    checks = [f.check for f in FILTERS if f.applies(req)]
    return pipeline.exhaustive.rank(Decision(req, snap, limit, checks))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(("seed", "nodes"), [(1, 600), (2, 60), (3, 8)])
def test_fast_ranking_equals_exhaustive(policy: str, seed: int, nodes: int) -> None:
    rng = random.Random(seed)
    snap = build_snapshot(nodes, rng)
    pipeline = Pipeline(PipelineConfig(policy=policy))
    for req in build_requests(60, rng):
        for limit in (0, 1, 5, 20):
            fast = pipeline.rank(req, snap, limit=limit)
            full = _exhaustive(pipeline, req, snap, limit)
            assert fast.candidates == full.candidates
            assert dict(fast.rejections) == dict(full.rejections)


def test_updated_index_equals_rebuilt() -> None:
    rng = random.Random(4)
    snap = build_snapshot(300, rng)
    index = SnapshotIndex.build(snap.nodes)
    changed = [snap.nodes[i] for i in (0, 5, 99, 200)]
    replaced: list[NodeView] = []
    for v in changed:
        replaced.append(
            NodeView(
                name=v.name,
                state=v.state,
                schedulable=v.schedulable,
                drivers=v.drivers,
                labels=v.labels,
                cpu_allocatable=v.cpu_allocatable,
                mem_allocatable=v.mem_allocatable,
                cpu_used=v.cpu_used // 2,
                mem_used=v.mem_used,
                workload_counts=v.workload_counts,
                total_instances=v.total_instances,
            )
        )
    by = {v.name: v for v in replaced}
    new_snap = Snapshot(tuple(by.get(n.name, n) for n in snap.nodes))
    inc = updated(index, changed, replaced)
    fresh = SnapshotIndex.build(new_snap.nodes)

    def shape(ix: SnapshotIndex) -> dict[object, list[str]]:
        return {
            (b.drivers, b.cpu_alloc, b.mem_alloc): [n.name for n in b.nodes] for b in ix.buckets
        }

    assert shape(inc) == shape(fresh)


def _group_shape(ix: SnapshotIndex) -> dict[object, list[tuple[int, int, list[str]]]]:
    return {
        (b.drivers, b.cpu_alloc, b.mem_alloc): [
            (g.cpu_used, g.mem_used, [n.name for n in g.nodes]) for g in b.groups
        ]
        for b in ix.buckets
    }


def _uniform_fleet(count: int, rng: random.Random) -> list[NodeView]:
    """An evenly filled fleet: few distinct (cpu_used, mem_used), so large groups of ties."""
    views = []
    for i in range(count):
        k = rng.choice((0, 0, 1, 1, 1, 2))
        views.append(
            NodeView(
                name=f"n{rng.randrange(10**6):06d}-{i}",
                state=NodeState.READY if rng.random() > 0.05 else NodeState.NOT_READY,
                schedulable=rng.random() > 0.05,
                drivers=frozenset({"process"}) if i % 7 else frozenset({"containerd"}),
                labels={"zone": rng.choice("ab")},
                cpu_allocatable=2500,
                mem_allocatable=1600 << 20,
                cpu_used=100 * k,
                mem_used=(64 << 20) * k,
                workload_counts={"web": k} if k and rng.random() < 0.5 else {},
                total_instances=k,
            )
        )
    return views


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_fast_ranking_equals_exhaustive_with_many_ties(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    snap = Snapshot(tuple(_uniform_fleet(400, rng)))
    pipeline = Pipeline(PipelineConfig(policy=policy))
    reqs = [
        request(workload="web"),
        request(workload="db"),
        request(workload="web", max_per_node=1),
        request(workload="db", node_selector={"zone": "b"}),
        request(workload="web", kind=WorkloadKind.CONTAINER, cpu_millis=2300),
    ]
    for req in reqs:
        for limit in (1, 3, 8, 40):
            for _ in range(2):  # the second decision on a snapshot uses the index
                fast = pipeline.rank(req, snap, limit=limit)
            full = _exhaustive(pipeline, req, snap, limit)
            assert fast.candidates == full.candidates
            assert dict(fast.rejections) == dict(full.rejections)


def test_updated_index_keeps_groups_equal_to_rebuilt() -> None:
    rng = random.Random(8)
    views = _uniform_fleet(200, rng)
    snap = Snapshot(tuple(views))
    index = SnapshotIndex.build(snap.nodes)
    before = _group_shape(index)
    current = {v.name: v for v in views}
    for step in range(300):
        v = current[rng.choice(list(current))]
        k = rng.randrange(4)
        replaced = NodeView(
            name=v.name,
            state=v.state if step % 50 else NodeState.LOST,
            schedulable=v.schedulable,
            drivers=v.drivers,
            labels=v.labels,
            cpu_allocatable=v.cpu_allocatable,
            mem_allocatable=v.mem_allocatable,
            cpu_used=100 * k,
            mem_used=(64 << 20) * k,
            workload_counts=v.workload_counts,
            total_instances=k,
        )
        current[v.name] = replaced
        index = updated(index, [v], [replaced])
        assert _group_shape(index) == _group_shape(SnapshotIndex.build(current.values()))
    # Copy-on-write: the first index is untouched by all of that.
    assert _group_shape(SnapshotIndex.build(snap.nodes)) == before


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_registry_reservations_keep_fast_ranking_exact(policy: str) -> None:
    """Reserve one by one as the scheduler does (incremental index per reservation), checking
    every decision against the exhaustive ranking of the same snapshot."""
    reg = Registry()
    for i in range(60):
        rec = reg.upsert(f"node-{i:03d}")
        rec.allocatable = Resources(cpu_millis=1000 + 500 * (i % 3), memory_bytes=4 << 30)
        rec.drivers = frozenset({"process"})
        rec.session = object()  # type: ignore[assignment]
    pipeline = Pipeline(PipelineConfig(policy=policy))
    placed: dict[str, set[str]] = {}
    for n in range(240):
        workload = f"w{n % 7}"
        req = request(
            instance=f"{workload}-{n}", workload=workload, cpu_millis=100, memory_bytes=1 << 28
        )
        snap = reg.snapshot()
        fast = pipeline.rank(req, snap, limit=4)
        assert fast.candidates == _exhaustive(pipeline, req, snap, 4).candidates
        for name in fast.candidates:
            node = reg.get(name)
            assert node is not None
            if reg.try_reserve(node, req, 30.0) is None:
                placed.setdefault(workload, set()).add(name)
                break
        if n % 17 == 0:
            # A release now and then moves a node back down.
            node = reg.get(fast.candidates[-1])
            assert node is not None
            if node.holds:
                reg.release(node, next(iter(node.holds)))
    assert isinstance(reg.snapshot().index, SnapshotIndex)
    if policy == "spread":
        # 240 / 7 replicas per workload on 60 nodes: spread puts each on its own node.
        assert all(len(nodes) >= 30 for nodes in placed.values())
    else:
        # Binpack fills a node before it opens the next: every node holding something is full
        # (no room for one more 100 m instance) but the one being filled, and far fewer nodes
        # are used than spread's 60 (each takes 10, 15 or 20).
        used = [rec for rec in reg if rec.holds]
        partly = [rec.name for rec in used if rec.free()[0] >= 100]
        assert len(partly) <= 1, partly
        assert all(rec.free()[0] >= 0 for rec in used)  # full, never overbooked
        assert sum(len(rec.holds) for rec in used) == 240
        assert len(used) <= 24


class _CountingScorer:
    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[attr-defined]
        self.indexed = inner.indexed  # type: ignore[attr-defined]
        self.calls = 0

    def score(self, req, node):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner.score(req, node)  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tied_nodes_are_not_all_scored(policy: str) -> None:
    """1,000 identical nodes tie; a decision looks at about `limit` of them, not all."""
    from tests.unit.scheduler.builders import node

    snap = Snapshot(tuple(node(name=f"n{i:04d}") for i in range(1000)))
    pipeline = Pipeline(PipelineConfig(policy=policy))
    scorer, _ = pipeline._scorers[0]
    counting = _CountingScorer(scorer)
    pipeline.indexed = IndexedStage(counting, FILTERS)  # type: ignore[arg-type]
    req = request()
    pipeline.rank(req, snap, limit=5)
    counting.calls = 0
    fast = pipeline.rank(req, snap, limit=5)
    assert fast.candidates == ("n0000", "n0001", "n0002", "n0003", "n0004")
    assert fast.stage == "indexed"
    assert counting.calls <= 10
