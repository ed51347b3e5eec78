"""Cordoned and draining nodes keep their instances but take no new ones."""

from __future__ import annotations

from orka.scheduler.snapshot import NodeView, PlacementRequest


class SchedulableFilter:
    __slots__ = ()
    name: str = "schedulable"

    def applies(self, req: PlacementRequest) -> bool:
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> str | None:
        return None if node.schedulable else "cordoned"
