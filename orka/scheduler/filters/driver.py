"""A node must have the runtime driver the workload's kind needs (`fake` stands in for any)."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import NodeView, PlacementRequest


class DriverFilter:
    __slots__ = ()
    name: str = "driver"
    per_bucket: bool = True

    def applies(self, req: PlacementRequest) -> bool:
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> fit.Reason | None:
        return fit.driver(req.kind, node.drivers)
