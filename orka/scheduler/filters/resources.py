"""The request must fit in what the node has left after allocations and reservations."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class ResourcesFilter:
    __slots__ = ()
    name: str = "resources"
    index_scope: IndexScope = "node"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.resources)

    def applies(self, req: PlacementRequest) -> bool:
        # Even a zero request is checked: a node whose allocatable shrank below its usage is full.
        return True
