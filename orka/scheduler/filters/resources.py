"""The request must fit in what the node has left after allocations and reservations."""

from __future__ import annotations

from orka.scheduler.snapshot import NodeView, PlacementRequest


class ResourcesFilter:
    __slots__ = ()
    name: str = "resources"

    def applies(self, req: PlacementRequest) -> bool:
        # Even a zero request is checked: a node whose allocatable shrank below its usage is full.
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> str | None:
        # CPU is named first so the same shortage always yields the same reason text.
        if req.cpu_millis > node.cpu_allocatable - node.cpu_used:
            return "insufficient cpu"
        if req.memory_bytes > node.mem_allocatable - node.mem_used:
            return "insufficient memory"
        return None
