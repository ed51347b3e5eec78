"""Cordoned and draining nodes keep their instances but take no new ones."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class SchedulableFilter:
    __slots__ = ()
    name: str = "schedulable"
    index_scope: IndexScope = "passed"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.schedulable)

    def applies(self, req: PlacementRequest) -> bool:
        return True
