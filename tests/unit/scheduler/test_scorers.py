from __future__ import annotations

from typing import Any

import pytest

from orka.scheduler.scorers import SCORERS
from orka.scheduler.scorers.binpack import BinpackScorer
from orka.scheduler.scorers.spread import SpreadScorer
from tests.unit.scheduler.builders import GIB, node, request


def _order(scorer: Any, nodes: dict[str, dict[str, Any]]) -> list[str]:
    req = request(cpu_millis=500, memory_bytes=GIB)
    scores = {name: scorer.score(req, node(name=name, **o)) for name, o in nodes.items()}
    return sorted(scores, key=lambda name: (-scores[name], name))


NODES: dict[str, dict[str, Any]] = {
    "empty": {},
    "half": {"cpu_used": 2000, "mem_used": 4 * GIB},
    "busy": {"cpu_used": 3000, "mem_used": 6 * GIB},
}


@pytest.mark.parametrize(
    ("scorer", "nodes", "expected"),
    [
        (SpreadScorer(), NODES, ["empty", "half", "busy"]),
        (BinpackScorer(), NODES, ["busy", "half", "empty"]),
        # Spread: fewer replicas of the workload beats more free resources.
        (
            SpreadScorer(),
            {
                "empty-with-replica": {"workload_counts": {"web": 1}},
                "busy-without": {"cpu_used": 3000, "mem_used": 6 * GIB},
                "busy-other-workload": {
                    "cpu_used": 3000,
                    "mem_used": 7 * GIB,
                    "workload_counts": {"db": 3},
                },
            },
            ["busy-without", "busy-other-workload", "empty-with-replica"],
        ),
        # Relative, not absolute, usage: 2000 of 16000 is emptier than 1000 of 4000.
        (
            SpreadScorer(),
            {
                "big": {"cpu_allocatable": 16000, "cpu_used": 2000, "mem_allocatable": 32 * GIB},
                "small": {"cpu_used": 1000},
            },
            ["big", "small"],
        ),
        (
            BinpackScorer(),
            {
                "big": {"cpu_allocatable": 16000, "cpu_used": 2000, "mem_allocatable": 32 * GIB},
                "small": {"cpu_used": 1000},
            },
            ["small", "big"],
        ),
    ],
    ids=["spread-free", "binpack-used", "spread-replicas-first", "spread-relative", "binpack-rel"],
)
def test_scorer_order(scorer: Any, nodes: dict[str, dict[str, Any]], expected: list[str]) -> None:
    assert _order(scorer, nodes) == expected


def test_binpack_counts_the_request_itself() -> None:
    req = request(cpu_millis=1000, memory_bytes=2 * GIB)
    assert BinpackScorer().score(req, node()) == pytest.approx(0.25)


def test_scorers_survive_a_node_offering_nothing() -> None:
    req = request(cpu_millis=0, memory_bytes=0)
    n = node(cpu_allocatable=0, mem_allocatable=0)
    assert SpreadScorer().score(req, n) == 0.0
    assert BinpackScorer().score(req, n) == 1.0


def test_scorer_table() -> None:
    assert sorted(SCORERS) == ["binpack", "spread"]
    assert all(name == scorer.name for name, scorer in SCORERS.items())
