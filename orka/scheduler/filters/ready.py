"""Only READY nodes take new instances; the reason says which other state the node is in."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import NodeView, PlacementRequest


class ReadyFilter:
    __slots__ = ()
    name: str = "ready"
    per_bucket: bool = True

    def applies(self, req: PlacementRequest) -> bool:
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> fit.Reason | None:
        # The schedulable half of the rule is SchedulableFilter's, so cordoned reads apart.
        return fit.availability(node.state, True)
