"""A node must have the runtime driver the workload's kind needs (`fake` stands in for any)."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class DriverFilter:
    __slots__ = ()
    name: str = "driver"
    index_scope: IndexScope = "bucket"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.driver)

    def applies(self, req: PlacementRequest) -> bool:
        return True
