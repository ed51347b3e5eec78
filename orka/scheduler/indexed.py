"""The indexed stage: the best `limit` nodes found through the snapshot's index, or no decision.

It looks at a handful of nodes instead of all of them (orka.scheduler.index explains how), and
decides only when it can prove those are the true best; otherwise it returns None and the
exhaustive stage decides, so a ranking is the same whichever stage made it. It runs only for
a single weighted scorer that opts in with an `IndexedWalk` (min-max normalisation of one raw
score never changes its order; a weighted sum of several has no walk).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator

from orka.scheduler.decision import Check, Decision, Ranking
from orka.scheduler.filters import Filter
from orka.scheduler.index import EPSILON, Group, IndexedWalk
from orka.scheduler.scorers import Scorer
from orka.scheduler.snapshot import NodeView, PlacementRequest


class IndexedStage:
    name = "indexed"

    @staticmethod
    def refuses(scorers: tuple[tuple[Scorer, float], ...]) -> str | None:
        """Why these weighted scorers cannot rank through this stage; None when they can."""
        if len(scorers) != 1:
            return f"{len(scorers)} weighted scorers: the indexed stage orders by one alone"
        scorer = scorers[0][0]
        if getattr(scorer, "indexed", None) is None:
            return f"scorer {scorer.name!r} does not opt into the indexed stage"
        return None

    def __init__(self, scorer: Scorer, filters: tuple[Filter, ...]) -> None:
        walk = getattr(scorer, "indexed", None)
        assert isinstance(walk, IndexedWalk), "IndexedStage.refuses() vets the scorer"
        self._score = scorer.score
        self._walk = walk
        # Asked once per bucket: every node of a bucket gives the same verdict. Filters the
        # index holds only passing nodes of are not asked at all.
        self._per_bucket = tuple(f.check for f in filters if f.index_scope == "bucket")
        self._per_node = tuple(f for f in filters if f.index_scope == "node")

    def rank(self, d: Decision) -> Ranking | None:
        index, limit, req = d.index, d.limit, d.req
        if index is None or limit is None:
            return None
        # Reason counts matter only when nothing fits; then they are worked out in full.
        lazy = d.rejections
        if limit == 0:
            return Ranking((), lazy=lazy, stage=self.name)
        cpu, mem, workload = req.cpu_millis, req.memory_bytes, req.workload
        parts = []
        per_bucket = self._per_bucket
        for b in index.buckets:
            first = b.groups[0].nodes[0]
            for check in per_bucket:
                if check(req, first) is not None:
                    break
            else:
                parts.append((b, cpu / b.cpu_alloc + mem / b.mem_alloc))
        walk = self._walk.walk
        skip_holders = self._walk.skips_holders
        stream: Iterator[tuple[float, Group]] = heapq.merge(
            *[walk(b, e) for b, e in parts], key=_first
        )
        rest = [f.check for f in self._per_node if f.applies(req)]
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
                if skip_holders and node.workload_counts.get(workload):
                    # It can only rank if fewer than `limit` other nodes fit, and then this
                    # stage defers to the exhaustive one anyway.
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
            if not _rejects(d.checks, req, node):
                found.append(node)
        score = self._score
        best = heapq.nsmallest(limit, [(-score(req, n), n.name) for n in found])
        return Ranking(tuple(name for _, name in best), lazy=lazy, stage=self.name)


def _rejects(checks: Iterable[Check], req: PlacementRequest, node: NodeView) -> bool:
    for check in checks:
        if check(req, node) is not None:
            return True
    return False


def _first(item: tuple[float, Group]) -> float:
    return item[0]
