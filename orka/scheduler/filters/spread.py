"""A workload's `max_per_node` caps how many of its instances one node may hold."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import NodeView, PlacementRequest


class SpreadFilter:
    __slots__ = ()
    name: str = "spread"
    per_bucket: bool = False

    def applies(self, req: PlacementRequest) -> bool:
        return req.max_per_node > 0

    def check(self, req: PlacementRequest, node: NodeView) -> fit.Reason | None:
        # check() stays correct on its own; applies() only lets the pipeline skip the call.
        return fit.spread(req.max_per_node, node.workload_counts.get(req.workload, 0))
