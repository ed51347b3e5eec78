"""The index-driven ranking must equal the exhaustive one, on varied random snapshots."""

from __future__ import annotations

import random

import pytest

from bench.bench_decisions import build_requests, build_snapshot
from orka.scheduler.index import SnapshotIndex, updated
from orka.scheduler.pipeline import POLICIES, Pipeline, PipelineConfig
from orka.scheduler.snapshot import NodeView, Snapshot


def _exhaustive(pipeline: Pipeline, req, snap: Snapshot, limit: int):  # type: ignore[no-untyped-def]
    checks = [f.check for f in pipeline._filters if f.applies(req)]
    return pipeline._rank_full(req, snap, limit, checks)


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
    index = SnapshotIndex.build(snap)
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
    fresh = SnapshotIndex.build(new_snap)

    def shape(ix: SnapshotIndex) -> dict[object, list[str]]:
        return {
            (b.drivers, b.cpu_alloc, b.mem_alloc): [n.name for n in b.nodes] for b in ix.buckets
        }

    assert shape(inc) == shape(fresh)
