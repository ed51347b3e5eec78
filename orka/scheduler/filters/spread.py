"""A workload's `max_per_node` caps how many of its instances one node may hold."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class SpreadFilter:
    __slots__ = ()
    name: str = "spread"
    index_scope: IndexScope = "node"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.spread)

    def applies(self, req: PlacementRequest) -> bool:
        return req.max_per_node > 0
