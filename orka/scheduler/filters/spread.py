"""A workload's `max_per_node` caps how many of its instances one node may hold."""

from __future__ import annotations

from orka.scheduler.snapshot import NodeView, PlacementRequest


class SpreadFilter:
    __slots__ = ()
    name: str = "spread"

    def applies(self, req: PlacementRequest) -> bool:
        return req.max_per_node > 0

    def check(self, req: PlacementRequest, node: NodeView) -> str | None:
        # check() stays correct on its own; applies() only lets the pipeline skip the call.
        limit = req.max_per_node
        if limit <= 0:
            return None
        count = node.workload_counts.get(req.workload, 0)
        if count < limit:
            return None
        noun = "replica" if count == 1 else "replicas"
        return f"spread: {count} {noun} already on node"
