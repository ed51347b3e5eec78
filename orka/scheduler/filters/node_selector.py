"""Every label in the request's node selector must be on the node with exactly that value."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class NodeSelectorFilter:
    __slots__ = ()
    name: str = "node_selector"
    index_scope: IndexScope = "node"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.selector)

    def applies(self, req: PlacementRequest) -> bool:
        return bool(req.node_selector)
