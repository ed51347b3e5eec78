"""Placement: filter the snapshot's nodes, score the feasible ones, rank them best first.

A ranking runs through named stages, each given the decision's context (`Decision`) and each
either deciding or passing on to the next: the `indexed` stage (orka.scheduler.indexed) when the
configured scorer opts into it, then the `exhaustive` stage, which always decides. Like Nomad's
LimitIterator and FeasibilityWrapper, the first is an optimisation that must give the same
answer as the second, and says so when it cannot.

Each scorer's raw values are min-max normalised over the feasible nodes to 0..100 and weighted,
so weights compare like with like whatever unit a scorer counts in. Equal totals are ordered by
node name, so the same snapshot and request always give the same ranking.
"""

from __future__ import annotations

import heapq
import math
import weakref
from dataclasses import dataclass

import structlog

from orka.errors import Invalid
from orka.scheduler.decision import Check, Decision, Ranking, Stage, filter_nodes
from orka.scheduler.filters import FILTERS, Filter
from orka.scheduler.index import SnapshotIndex
from orka.scheduler.indexed import IndexedStage
from orka.scheduler.scorers import SCORERS, Scorer
from orka.scheduler.snapshot import NodeView, PlacementRequest, Snapshot

__all__ = [
    "POLICIES",
    "Check",
    "Decision",
    "ExhaustiveStage",
    "Pipeline",
    "PipelineConfig",
    "Ranking",
    "Stage",
    "filter_nodes",
]

log = structlog.get_logger("orka.scheduler.pipeline")

# Policy name -> scorer weights.
POLICIES: dict[str, dict[str, float]] = {
    "spread": {"spread": 1.0},
    "binpack": {"binpack": 1.0},
}

_NORMALISED_MAX = 100.0


@dataclass
class PipelineConfig:
    policy: str = "spread"
    # Replaces the policy's weights entirely when set.
    weights: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            known = ", ".join(sorted(POLICIES))
            raise Invalid(f"policy: unknown placement policy {self.policy!r} (known: {known})")
        if self.weights is not None:
            for name, weight in self.weights.items():
                if name not in SCORERS:
                    known = ", ".join(sorted(SCORERS))
                    raise Invalid(f"weights: unknown scorer {name!r} (known: {known})")
                if not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
                    raise Invalid(f"weights: weight of {name!r} must be a finite number >= 0")

    @property
    def effective_weights(self) -> dict[str, float]:
        weights = self.weights if self.weights is not None else POLICIES[self.policy]
        return dict(weights)


class ExhaustiveStage:
    """Every node through every filter, every feasible node scored: always decides."""

    name = "exhaustive"

    def __init__(self, scorers: tuple[tuple[Scorer, float], ...]) -> None:
        self._scorers = scorers

    def rank(self, decision: Decision) -> Ranking:
        req, limit = decision.req, decision.limit
        feasible, rejections = filter_nodes(req, decision.snapshot.nodes, decision.checks)
        if not feasible:
            return Ranking((), rejections, stage=self.name)
        totals = self._totals(req, feasible)
        # Negated totals let one ascending order put the best first and break ties by name.
        keyed = [(-total, node.name) for total, node in zip(totals, feasible, strict=True)]
        if limit is not None and limit < len(keyed):
            best = heapq.nsmallest(limit, keyed)
        else:
            best = sorted(keyed)
        return Ranking(tuple(name for _, name in best), rejections, stage=self.name)

    def _totals(self, req: PlacementRequest, feasible: list[NodeView]) -> list[float]:
        totals = [0.0] * len(feasible)
        for scorer, weight in self._scorers:
            score = scorer.score
            raw = [score(req, node) for node in feasible]
            low = min(raw)
            high = max(raw)
            if high <= low:
                # Every node scored the same: the scorer has no preference to contribute.
                continue
            scale = _NORMALISED_MAX * weight / (high - low)
            totals = [t + (r - low) * scale for t, r in zip(totals, raw, strict=True)]
        return totals


class Pipeline:
    def __init__(self, config: PipelineConfig | None = None) -> None:
        self.config = config if config is not None else PipelineConfig()
        # Zero weights are dropped here so the hot path never scores for nothing.
        self._scorers: tuple[tuple[Scorer, float], ...] = tuple(
            (SCORERS[name], weight)
            for name, weight in sorted(self.config.effective_weights.items())
            if weight > 0
        )
        self._filters: tuple[Filter, ...] = FILTERS
        self.exhaustive = ExhaustiveStage(self._scorers)
        # Why decisions with a limit cannot take the indexed stage; None when they can.
        self.fallback: str | None = IndexedStage.refuses(self._scorers)
        self.indexed: IndexedStage | None = None
        if self.fallback is None:
            self.indexed = IndexedStage(self._scorers[0][0], self._filters)
        else:
            log.info("placement ranks every node", why=self.fallback)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages a decision with a limit goes through, in order."""
        return (self.indexed, self.exhaustive) if self.indexed is not None else (self.exhaustive,)

    def rank(self, req: PlacementRequest, snapshot: Snapshot, limit: int | None = None) -> Ranking:
        if limit is not None and limit < 0:
            raise Invalid(f"limit must be >= 0, got {limit}")
        decision = Decision(
            req, snapshot, limit, [f.check for f in self._filters if f.applies(req)]
        )
        if limit is not None and self.indexed is not None:
            decision.index = _MEMO.index(snapshot)
            ranking = self.indexed.rank(decision)
            if ranking is not None:
                return ranking
        return self.exhaustive.rank(decision)


class _IndexMemo:
    """The index of the last snapshot that came without one, built on its second decision (one
    decision is cheaper without). A cache of derived data kept apart from the snapshot, which a
    decision never changes, and shared by every pipeline of the process (several policies may
    rank on one snapshot)."""

    __slots__ = ("_index", "_seen")

    def __init__(self) -> None:
        self._seen: weakref.ref[Snapshot] | None = None
        self._index: SnapshotIndex | None = None

    def index(self, snapshot: Snapshot) -> SnapshotIndex | None:
        if snapshot.index is not None:
            return snapshot.index
        if self._seen is None or self._seen() is not snapshot:
            self._seen = weakref.ref(snapshot)
            self._index = None
            return None
        if self._index is None:
            self._index = SnapshotIndex.build(snapshot.nodes)
        return self._index


_MEMO = _IndexMemo()
