"""Placement: filter the snapshot's nodes, score the feasible ones, rank them best first.

Each scorer's raw values are min-max normalised over the feasible nodes to 0..100 and weighted,
so weights compare like with like whatever unit a scorer counts in. Equal totals are ordered by
node name, so the same snapshot and request always give the same ranking.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from orka.errors import Invalid
from orka.scheduler.filters import FILTERS, Filter
from orka.scheduler.scorers import SCORERS, Scorer
from orka.scheduler.snapshot import NodeView, PlacementRequest, Snapshot

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


def format_reasons(rejections: Mapping[str, int]) -> str:
    """'3 nodes: insufficient memory; 1 node: cordoned': most common reason first."""
    if not rejections:
        return "no nodes"
    parts = sorted(rejections.items(), key=lambda item: (-item[1], item[0]))
    return "; ".join(
        f"{count} {'node' if count == 1 else 'nodes'}: {reason}" for reason, count in parts
    )


@dataclass(frozen=True, slots=True)
class Ranking:
    # Node names, best first; at most `limit` of them when rank() was given one.
    candidates: tuple[str, ...]
    # Reason -> number of nodes the filters rejected for it.
    rejections: Mapping[str, int] = field(default_factory=dict)

    def reasons_text(self) -> str:
        """Why nodes were left out; "no nodes" when the cluster had none at all."""
        if not self.rejections and self.candidates:
            return ""
        return format_reasons(self.rejections)


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

    def rank(self, req: PlacementRequest, snapshot: Snapshot, limit: int | None = None) -> Ranking:
        if limit is not None and limit < 0:
            raise Invalid(f"limit must be >= 0, got {limit}")
        checks = [f.check for f in self._filters if f.applies(req)]

        rejections: dict[str, int] = {}
        feasible: list[NodeView] = []
        keep = feasible.append
        for node in snapshot.nodes:
            for check in checks:
                reason = check(req, node)
                if reason is not None:
                    rejections[reason] = rejections.get(reason, 0) + 1
                    break
            else:
                keep(node)

        if not feasible:
            return Ranking((), rejections)
        totals = self._totals(req, feasible)
        # Negated totals let one ascending order put the best first and break ties by name.
        keyed = [(-total, node.name) for total, node in zip(totals, feasible, strict=True)]
        if limit is not None and limit < len(keyed):
            best = heapq.nsmallest(limit, keyed)
        else:
            best = sorted(keyed)
        return Ranking(tuple(name for _, name in best), rejections)

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
