"""The ranking stages: the indexed one is opted into by scorers, and no decision writes to the
snapshot it reads."""

from __future__ import annotations

import dataclasses
import random

import pytest
import structlog.testing

from bench.bench_decisions import build_requests, build_snapshot
from orka.models import Resources
from orka.scheduler.pipeline import Pipeline, PipelineConfig
from orka.scheduler.registry import Registry
from orka.scheduler.scorers import SCORERS
from orka.scheduler.snapshot import NodeView, PlacementRequest, Snapshot
from tests.unit.scheduler.builders import node, request


class MostFreeCpuScorer:
    """A scorer added later that knows nothing of the index: prefers the most free cpu."""

    name = "most_free_cpu"

    def score(self, req: PlacementRequest, n: NodeView) -> float:
        return float(n.cpu_allocatable - n.cpu_used)


def test_a_scorer_that_does_not_opt_in_ranks_through_the_exhaustive_stage_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(SCORERS, MostFreeCpuScorer.name, MostFreeCpuScorer())
    with structlog.testing.capture_logs() as logs:
        pipeline = Pipeline(PipelineConfig(weights={"most_free_cpu": 1.0}))
    assert pipeline.fallback == "scorer 'most_free_cpu' does not opt into the indexed stage"
    assert [e["why"] for e in logs if e["event"] == "placement ranks every node"] == [
        pipeline.fallback
    ]
    assert [s.name for s in pipeline.stages] == ["exhaustive"]
    snap = Snapshot.of(
        [
            node(name="a", cpu_used=3000),
            node(name="b", cpu_used=1000),
            node(name="c", cpu_used=0),
            node(name="d", cpu_used=2000),
            node(name="full", cpu_used=4000),
        ]
    )
    for _ in range(3):  # later decisions on a snapshot are the indexed stage's chance
        ranking = pipeline.rank(request(), snap, limit=3)
        assert ranking.candidates == ("c", "b", "d")
        assert ranking.stage == "exhaustive"


@pytest.mark.parametrize("policy", ["spread", "binpack"])
def test_the_built_in_scorers_opt_in(policy: str) -> None:
    pipeline = Pipeline(PipelineConfig(policy=policy))
    assert pipeline.fallback is None
    assert [s.name for s in pipeline.stages] == ["indexed", "exhaustive"]
    snap = Snapshot.of([node(name=f"n{i}", cpu_used=100 * i) for i in range(20)])
    assert pipeline.rank(request(), snap, limit=2).stage == "exhaustive"  # first: no index yet
    second = pipeline.rank(request(), snap, limit=2)
    assert second.stage == "indexed"
    assert second.candidates == (("n0", "n1") if policy == "spread" else ("n19", "n18"))
    # Without a limit every node is ranked: only the exhaustive stage does that.
    assert pipeline.rank(request(), snap).stage == "exhaustive"


def test_two_weighted_scorers_fall_back_openly() -> None:
    pipeline = Pipeline(PipelineConfig(weights={"spread": 1.0, "binpack": 1.0}))
    assert pipeline.fallback == "2 weighted scorers: the indexed stage orders by one alone"
    assert [s.name for s in pipeline.stages] == ["exhaustive"]


def _fingerprint(snap: Snapshot) -> tuple[object, ...]:
    """Every attribute of the snapshot and of each of its views, by identity and by value."""
    views = tuple(
        tuple((f.name, getattr(v, f.name)) for f in dataclasses.fields(v)) for v in snap.nodes
    )
    counts = tuple(dict(v.workload_counts) for v in snap.nodes)
    return (
        id(snap.nodes),
        id(snap.index),
        id(snap.by_name),
        dict(snap.by_name),
        views,
        counts,
    )


@pytest.mark.parametrize("policy", ["spread", "binpack"])
def test_decisions_do_not_change_the_snapshot(policy: str) -> None:
    rng = random.Random(3)
    snap = build_snapshot(300, rng)
    before = _fingerprint(snap)
    pipeline = Pipeline(PipelineConfig(policy=policy))
    for req in build_requests(30, rng):
        for limit in (None, 0, 1, 5):
            pipeline.rank(req, snap, limit=limit)
    assert _fingerprint(snap) == before
    assert snap.index is None  # the index built for its later decisions is the pipeline's
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.index = None  # type: ignore[misc]


def test_decisions_do_not_change_a_registry_snapshot_or_its_index() -> None:
    reg = Registry()
    for i in range(30):
        rec = reg.upsert(f"n{i:02d}")
        rec.allocatable = Resources(cpu_millis=1000 + 100 * (i % 4), memory_bytes=4 << 30)
        rec.drivers = frozenset({"process"})
    reg.snapshot()
    reg.changed()
    snap = reg.snapshot()  # the second one carries an index
    assert snap.index is not None
    index_before = [
        [(g.cpu_used, g.mem_used, list(g.nodes)) for g in b.groups] for b in snap.index.buckets
    ]
    before = _fingerprint(snap)
    pipeline = Pipeline()
    for i in range(50):
        ranking = pipeline.rank(request(instance=f"w-{i}", cpu_millis=50 * i), snap, limit=3)
        assert ranking.stage in ("indexed", "exhaustive")
    assert _fingerprint(snap) == before
    assert [
        [(g.cpu_used, g.mem_used, list(g.nodes)) for g in b.groups] for b in snap.index.buckets
    ] == index_before
