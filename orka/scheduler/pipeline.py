"""Placement: filter the snapshot's nodes, score the feasible ones, rank them best first.

Each scorer's raw values are min-max normalised over the feasible nodes to 0..100 and weighted,
so weights compare like with like whatever unit a scorer counts in. Equal totals are ordered by
node name, so the same snapshot and request always give the same ranking.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from orka.errors import Invalid
from orka.scheduler.filters import FILTERS, Filter
from orka.scheduler.index import EPSILON, Group, SnapshotIndex, walk_binpack, walk_spread
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


class Ranking:
    """Candidates best first, and why the other nodes were left out.

    The reason counts matter only when nothing fits (they become the Unschedulable message),
    so the fast path computes them on first access rather than filtering every node.
    """

    __slots__ = ("_lazy", "_rejections", "candidates")

    def __init__(
        self,
        candidates: tuple[str, ...],
        rejections: Mapping[str, int] | None = None,
        *,
        lazy: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        # Node names, best first; at most `limit` of them when rank() was given one.
        self.candidates = candidates
        self._rejections = rejections if rejections is not None or lazy else {}
        self._lazy = lazy

    @property
    def rejections(self) -> Mapping[str, int]:
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
        return f"Ranking(candidates={self.candidates!r}, rejections={dict(self.rejections)!r})"

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
        # The index-driven path knows the shape of the built-in scorers; one scorer only, as
        # min-max normalisation of a single raw score never changes its order.
        self._fast: str | None = None
        if len(self._scorers) == 1 and self._scorers[0][0].name in ("spread", "binpack"):
            self._fast = self._scorers[0][0].name
        self._driver_check = next((f.check for f in self._filters if f.name == "driver"), None)
        # Filters every node of the index passes already: it holds only READY, schedulable
        # nodes, and each bucket's driver set is checked once for all its nodes.
        self._indexed: frozenset[str] = frozenset({"ready", "schedulable"})
        if self._driver_check is not None:
            self._indexed |= {"driver"}

    def rank(self, req: PlacementRequest, snapshot: Snapshot, limit: int | None = None) -> Ranking:
        if limit is not None and limit < 0:
            raise Invalid(f"limit must be >= 0, got {limit}")
        checks = [f.check for f in self._filters if f.applies(req)]
        if limit is not None and self._fast is not None:
            index = _index_of(snapshot)
            if index is not None:
                fast = self._rank_fast(req, snapshot, index, limit, checks)
                if fast is not None:
                    return fast
        return self._rank_full(req, snapshot, limit, checks)

    def _rank_fast(
        self,
        req: PlacementRequest,
        snapshot: Snapshot,
        index: SnapshotIndex,
        limit: int,
        checks: list[Callable[[PlacementRequest, NodeView], str | None]],
    ) -> Ranking | None:
        """The best `limit` nodes from the index; None when it cannot prove they are the best."""

        def lazy() -> Mapping[str, int]:
            return _rejections(req, snapshot, checks)

        if limit == 0:
            return Ranking((), lazy=lazy)
        cpu, mem, workload = req.cpu_millis, req.memory_bytes, req.workload
        spread = self._fast == "spread"
        driver_check = self._driver_check
        parts = []
        for b in index.buckets:
            # Every node of a bucket has the same drivers: one check speaks for all of them.
            if driver_check is not None and driver_check(req, b.groups[0].nodes[0]) is not None:
                continue
            parts.append((b, cpu / b.cpu_alloc + mem / b.mem_alloc))
        walk = walk_spread if spread else walk_binpack
        stream: Iterator[tuple[float, Group]] = heapq.merge(
            *[walk(b, e) for b, e in parts], key=_first
        )
        indexed = self._indexed
        rest = [f.check for f in self._filters if f.name not in indexed and f.applies(req)]
        found: list[NodeView] = []
        keep = found.append
        bound = math.inf
        want = limit  # found must reach this before the bound is known
        for key, group in stream:
            if key > bound:
                break
            # Nodes of one group score the same, so beyond the first `limit` feasible ones (by
            # name) none of them can rank.
            stop = len(found) + limit
            for node in group.nodes:
                if spread and node.workload_counts.get(workload):
                    # Scored at least 2 below any empty feasible node: it can only rank if fewer
                    # than `limit` of those exist, and then the exhaustive path runs anyway.
                    continue
                for check in rest:
                    if check(req, node) is not None:
                        break
                else:
                    keep(node)
                    if len(found) >= want:
                        if want:
                            bound = key + EPSILON
                            want = 0
                        if len(found) == stop:
                            break
        if len(found) < limit:
            return None
        for node in index.odd:
            for check in checks:
                if check(req, node) is not None:
                    break
            else:
                found.append(node)
        score = self._scorers[0][0].score
        best = heapq.nsmallest(limit, [(-score(req, n), n.name) for n in found])
        return Ranking(tuple(name for _, name in best), lazy=lazy)

    def _rank_full(
        self,
        req: PlacementRequest,
        snapshot: Snapshot,
        limit: int | None,
        checks: list[Callable[[PlacementRequest, NodeView], str | None]],
    ) -> Ranking:
        feasible, rejections = _filter(req, snapshot, checks)
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


def _first(item: tuple[float, Group]) -> float:
    return item[0]


def _filter(
    req: PlacementRequest,
    snapshot: Snapshot,
    checks: list[Callable[[PlacementRequest, NodeView], str | None]],
) -> tuple[list[NodeView], dict[str, int]]:
    """The nodes every check passes, and how many nodes each first failing reason rejected."""
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
    return feasible, rejections


def _rejections(
    req: PlacementRequest,
    snapshot: Snapshot,
    checks: list[Callable[[PlacementRequest, NodeView], str | None]],
) -> dict[str, int]:
    return _filter(req, snapshot, checks)[1]


def _index_of(snapshot: Snapshot) -> SnapshotIndex | None:
    """The snapshot's index, built on its second decision: one decision is cheaper without."""
    index = snapshot.index
    if isinstance(index, SnapshotIndex):
        return index
    uses = snapshot.uses + 1
    object.__setattr__(snapshot, "uses", uses)
    if uses < 2:
        return None
    index = SnapshotIndex.build(snapshot)
    object.__setattr__(snapshot, "index", index)
    return index
