"""Every label in the request's node selector must be on the node with exactly that value."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import NodeView, PlacementRequest


class NodeSelectorFilter:
    __slots__ = ()
    name: str = "node_selector"
    per_bucket: bool = False

    def applies(self, req: PlacementRequest) -> bool:
        return bool(req.node_selector)

    def check(self, req: PlacementRequest, node: NodeView) -> fit.Reason | None:
        return fit.selector(req.node_selector, node.labels)
