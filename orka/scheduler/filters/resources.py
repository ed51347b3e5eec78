"""The request must fit in what the node has left after allocations and reservations."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import NodeView, PlacementRequest


class ResourcesFilter:
    __slots__ = ()
    name: str = "resources"
    per_bucket: bool = False

    def applies(self, req: PlacementRequest) -> bool:
        # Even a zero request is checked: a node whose allocatable shrank below its usage is full.
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> fit.Reason | None:
        return fit.resources(
            req.cpu_millis,
            req.memory_bytes,
            node.cpu_allocatable,
            node.mem_allocatable,
            node.cpu_used,
            node.mem_used,
        )
