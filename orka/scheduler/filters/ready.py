"""Only READY nodes take new instances; the reason says which other state the node is in."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class ReadyFilter:
    __slots__ = ()
    name: str = "ready"
    index_scope: IndexScope = "passed"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.ready)

    def applies(self, req: PlacementRequest) -> bool:
        return True
