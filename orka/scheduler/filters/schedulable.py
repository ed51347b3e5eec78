"""Cordoned and draining nodes keep their instances but take no new ones."""

from __future__ import annotations

from orka import fit
from orka.models import NodeState
from orka.scheduler.snapshot import NodeView, PlacementRequest


class SchedulableFilter:
    __slots__ = ()
    name: str = "schedulable"
    per_bucket: bool = True

    def applies(self, req: PlacementRequest) -> bool:
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> fit.Reason | None:
        # Asked as a READY node: the state half of the rule is ReadyFilter's.
        return fit.availability(NodeState.READY, node.schedulable)
