"""A node must have the runtime driver the workload's kind needs (`fake` stands in for any)."""

from __future__ import annotations

from orka.models import FAKE_DRIVER, KIND_DRIVER
from orka.scheduler.snapshot import NodeView, PlacementRequest


class DriverFilter:
    __slots__ = ()
    name: str = "driver"

    def applies(self, req: PlacementRequest) -> bool:
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> str | None:
        driver = KIND_DRIVER[req.kind]
        drivers = node.drivers
        if driver in drivers or FAKE_DRIVER in drivers:
            return None
        return f"no {driver} driver"
