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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from orka import fit
from orka.errors import Invalid
from orka.scheduler.filters import FILTERS, Filter
from orka.scheduler.index import SnapshotIndex
from orka.scheduler.scorers import SCORERS, Scorer
from orka.scheduler.snapshot import NodeView, PlacementRequest, Snapshot

log = structlog.get_logger("orka.scheduler.pipeline")

# Policy name -> scorer weights.
POLICIES: dict[str, dict[str, float]] = {
    "spread": {"spread": 1.0},
    "binpack": {"binpack": 1.0},
}

_NORMALISED_MAX = 100.0

Check = Callable[[PlacementRequest, NodeView], fit.Reason | None]


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


@dataclass(slots=True)
class Decision:
    """One ranking's context: the request, the snapshot it reads (never writes), and what the
    stages work out for this decision alone."""

    req: PlacementRequest
    snapshot: Snapshot
    # At most this many candidates; None for every feasible node.
    limit: int | None
    # The filters that can reject this request, in precedence order.
    checks: list[Check]
    # The snapshot's index, when one exists for it.
    index: SnapshotIndex | None = None

    def rejections(self) -> dict[fit.Reason, int]:
        return filter_nodes(self.req, self.snapshot.nodes, self.checks)[1]


class Ranking:
    """Candidates best first, why the other nodes were left out, and which stage decided.

    The reason counts matter only when nothing fits (they become the Unschedulable message),
    so the indexed stage computes them on first access rather than filtering every node.
    """

    __slots__ = ("_lazy", "_rejections", "candidates", "stage")

    def __init__(
        self,
        candidates: tuple[str, ...],
        rejections: Mapping[fit.Reason, int] | None = None,
        *,
        lazy: Callable[[], Mapping[fit.Reason, int]] | None = None,
        stage: str = "exhaustive",
    ) -> None:
        # Node names, best first; at most `limit` of them when rank() was given one.
        self.candidates = candidates
        self._rejections = rejections if rejections is not None or lazy else {}
        self._lazy = lazy
        self.stage = stage

    @property
    def rejections(self) -> Mapping[fit.Reason, int]:
        """Reason -> number of nodes the filters rejected for it."""
        if self._rejections is None:
            assert self._lazy is not None
            self._rejections = self._lazy()
            self._lazy = None
        return self._rejections

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ranking):
            return NotImplemented
        return self.candidates == other.candidates and self.rejections == other.rejections

    def __repr__(self) -> str:
        return (
            f"Ranking(candidates={self.candidates!r}, rejections={dict(self.rejections)!r},"
            f" stage={self.stage!r})"
        )

    def reason_counts(self) -> list[fit.ReasonCount]:
        return fit.count_reasons(self.rejections)

    def reasons_text(self) -> str:
        """Why nodes were left out; "no nodes" when the cluster had none at all."""
        if not self.rejections and self.candidates:
            return ""
        return fit.format_reasons(self.reason_counts())


class Stage(Protocol):
    name: str

    def rank(self, decision: Decision) -> Ranking | None:
        """The ranking, or None to leave the decision to the next stage."""
        ...


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
        # Imported here: the indexed stage builds on this module's Decision and Ranking.
        from orka.scheduler.indexed import IndexedStage

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


def filter_nodes(
    req: PlacementRequest, nodes: tuple[NodeView, ...] | list[NodeView], checks: list[Check]
) -> tuple[list[NodeView], dict[fit.Reason, int]]:
    """The nodes every check passes, and how many nodes each first failing reason rejected."""
    rejections: dict[fit.Reason, int] = {}
    feasible: list[NodeView] = []
    keep = feasible.append
    for node in nodes:
        for check in checks:
            reason = check(req, node)
            if reason is not None:
                rejections[reason] = rejections.get(reason, 0) + 1
                break
        else:
            keep(node)
    return feasible, rejections
