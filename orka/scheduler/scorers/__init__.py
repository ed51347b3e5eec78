"""The placement scorers, by the name policies and weights refer to them."""

from __future__ import annotations

from typing import Protocol

from orka.scheduler.scorers.binpack import BinpackScorer
from orka.scheduler.scorers.spread import SpreadScorer
from orka.scheduler.snapshot import NodeView, PlacementRequest


class Scorer(Protocol):
    """`name` and `score`; a scorer may also carry `indexed: IndexedWalk` to opt into the
    indexed stage (orka.scheduler.index). One without it ranks through the exhaustive stage,
    and the pipeline says so (`Pipeline.fallback`, and a log line when it is built)."""

    name: str

    def score(self, req: PlacementRequest, node: NodeView) -> float:
        """A raw value, higher is better; the pipeline normalises it over the feasible nodes."""
        ...


SCORERS: dict[str, Scorer] = {
    scorer.name: scorer
    for scorer in (
        SpreadScorer(),
        BinpackScorer(),
    )
}

__all__ = ["SCORERS", "Scorer"]
