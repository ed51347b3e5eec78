from __future__ import annotations

from typing import Any

import pytest

from orka import fit
from orka.errors import Invalid
from orka.models import NodeState
from orka.scheduler.pipeline import (
    POLICIES,
    Pipeline,
    PipelineConfig,
    Ranking,
)
from orka.scheduler.snapshot import Snapshot
from tests.unit.scheduler.builders import GIB, node, request, snapshot


def _mixed() -> Snapshot:
    return snapshot(
        node(name="empty"),
        node(name="half", cpu_used=2000, mem_used=4 * GIB),
        node(name="busy", cpu_used=3000, mem_used=6 * GIB),
        node(name="full-a", mem_used=8 * GIB),
        node(name="full-b", mem_used=8 * GIB),
        node(name="full-c", mem_used=8 * GIB),
        node(name="cordoned", schedulable=False),
        node(name="gone", state=NodeState.LOST),
    )


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("spread", ("empty", "half", "busy")),
        ("binpack", ("busy", "half", "empty")),
    ],
)
def test_policy_orders_feasible_nodes(policy: str, expected: tuple[str, ...]) -> None:
    ranking = Pipeline(PipelineConfig(policy=policy)).rank(request(), _mixed())
    assert ranking.candidates == expected
    assert ranking.rejections == {fit.INSUFFICIENT_MEMORY: 3, fit.CORDONED: 1, fit.LOST: 1}
    assert ranking.reasons_text() == "3 nodes: insufficient memory; 1 node: cordoned; 1 node: lost"


def test_first_failing_filter_names_the_reason() -> None:
    # Lost and out of memory: the cheaper, more fundamental reason wins.
    snap = snapshot(node(state=NodeState.LOST, mem_used=8 * GIB))
    assert Pipeline().rank(request(), snap).rejections == {fit.LOST: 1}


def test_ties_are_broken_by_name() -> None:
    snap = snapshot(*(node(name=name) for name in ("c", "a", "d", "b")))
    for policy in POLICIES:
        ranking = Pipeline(PipelineConfig(policy=policy)).rank(request(), snap)
        assert ranking.candidates == ("a", "b", "c", "d")


def test_limit_keeps_only_the_best() -> None:
    snap = snapshot(*(node(name=f"n{i}", cpu_used=i * 100) for i in range(10)))
    pipeline = Pipeline()
    assert pipeline.rank(request(), snap, limit=3).candidates == ("n0", "n1", "n2")
    assert pipeline.rank(request(), snap, limit=0).candidates == ()
    assert len(pipeline.rank(request(), snap, limit=50).candidates) == 10
    assert (
        pipeline.rank(request(), snap, limit=3).candidates
        == (pipeline.rank(request(), snap).candidates[:3])
    )


def test_limit_with_ties_uses_name_order() -> None:
    snap = snapshot(*(node(name=name) for name in ("e", "d", "c", "b", "a")))
    assert Pipeline().rank(request(), snap, limit=2).candidates == ("a", "b")


def test_negative_limit_is_invalid() -> None:
    with pytest.raises(Invalid, match="limit"):
        Pipeline().rank(request(), _mixed(), limit=-1)


def test_normalisation_makes_weights_compare_like_with_like() -> None:
    # Raw spread values span ~0.25 while binpack spans the same width in the other direction;
    # after normalisation each contributes 0..100, so the heavier weight decides.
    snap = snapshot(
        node(name="empty"),
        node(name="busy", cpu_used=3000, mem_used=6 * GIB),
    )
    req = request()
    spread_heavy = PipelineConfig(weights={"spread": 2.0, "binpack": 1.0})
    binpack_heavy = PipelineConfig(weights={"spread": 1.0, "binpack": 2.0})
    assert Pipeline(spread_heavy).rank(req, snap).candidates == ("empty", "busy")
    assert Pipeline(binpack_heavy).rank(req, snap).candidates == ("busy", "empty")
    # Equal weights cancel exactly, leaving the name order.
    equal = PipelineConfig(weights={"spread": 1.0, "binpack": 1.0})
    assert Pipeline(equal).rank(req, snap).candidates == ("busy", "empty")


def test_normalised_totals_are_weighted_sums() -> None:
    # Three nodes evenly spaced in usage; spread normalises them to 100, 50, 0 and a second,
    # constant-valued scorer (all nodes equal) contributes nothing.
    snap = snapshot(
        node(name="a", cpu_used=0, mem_used=0),
        node(name="b", cpu_used=1000, mem_used=2 * GIB),
        node(name="c", cpu_used=2000, mem_used=4 * GIB),
    )
    pipeline = Pipeline(PipelineConfig(weights={"spread": 3.0}))
    req = request()
    feasible = list(snap.nodes)
    assert pipeline.exhaustive._totals(req, feasible) == pytest.approx([300.0, 150.0, 0.0])


def test_single_feasible_node_and_constant_scores() -> None:
    ranking = Pipeline().rank(request(), snapshot(node(name="only")))
    assert ranking == Ranking(("only",), {})
    assert ranking.reasons_text() == ""


def test_zero_weights_rank_by_name() -> None:
    snap = snapshot(node(name="b"), node(name="a", cpu_used=3000))
    pipeline = Pipeline(PipelineConfig(weights={"spread": 0.0}))
    assert pipeline.rank(request(), snap).candidates == ("a", "b")


def test_empty_cluster() -> None:
    ranking = Pipeline().rank(request(), snapshot())
    assert ranking.candidates == ()
    assert ranking.reasons_text() == "no nodes"


def test_selector_and_spread_reasons_aggregate() -> None:
    snap = snapshot(
        node(name="a", labels={"zone": "us"}),
        node(name="b", labels={}),
        node(name="c", labels={"zone": "eu"}, workload_counts={"web": 2}),
        node(name="d", labels={"zone": "eu"}, workload_counts={"web": 1}),
    )
    req = request(node_selector={"zone": "eu"}, max_per_node=2)
    ranking = Pipeline().rank(req, snap)
    assert ranking.candidates == ("d",)
    assert ranking.reasons_text() == (
        "2 nodes: label zone != eu; 1 node: spread: 2 replicas already on node"
    )


@pytest.mark.parametrize(
    ("rejections", "expected"),
    [
        ({}, "no nodes"),
        ({fit.CORDONED: 1}, "1 node: cordoned"),
        ({fit.CORDONED: 2}, "2 nodes: cordoned"),
        (
            {fit.CORDONED: 1, fit.INSUFFICIENT_MEMORY: 3},
            "3 nodes: insufficient memory; 1 node: cordoned",
        ),
        # Equal counts: alphabetical, so the text is stable.
        (
            {fit.LOST: 2, fit.CORDONED: 2, fit.LEFT: 5},
            "5 nodes: left; 2 nodes: cordoned; 2 nodes: lost",
        ),
    ],
)
def test_format_reasons(rejections: dict[fit.Reason, int], expected: str) -> None:
    assert fit.format_reasons(fit.count_reasons(rejections)) == expected
    assert Ranking((), rejections).reasons_text() == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "random"}, "unknown placement policy 'random'"),
        ({"weights": {"spread": 1.0, "nope": 1.0}}, "unknown scorer 'nope'"),
        ({"weights": {"spread": -1.0}}, "weight of 'spread'"),
        ({"weights": {"spread": float("nan")}}, "weight of 'spread'"),
    ],
)
def test_invalid_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(Invalid, match=match):
        PipelineConfig(**kwargs)


def test_weights_override_policy() -> None:
    config = PipelineConfig(policy="spread", weights={"binpack": 1.0})
    assert config.effective_weights == {"binpack": 1.0}
    assert PipelineConfig(policy="binpack").effective_weights == POLICIES["binpack"]


def test_rank_does_not_change_the_snapshot() -> None:
    snap = _mixed()
    before = [(n.name, n.cpu_used, n.mem_used, dict(n.workload_counts)) for n in snap.nodes]
    Pipeline().rank(request(), snap)
    after = [(n.name, n.cpu_used, n.mem_used, dict(n.workload_counts)) for n in snap.nodes]
    assert before == after
