"""Every label in the request's node selector must be on the node with exactly that value."""

from __future__ import annotations

from orka.scheduler.snapshot import NodeView, PlacementRequest


class NodeSelectorFilter:
    __slots__ = ()
    name: str = "node_selector"

    def applies(self, req: PlacementRequest) -> bool:
        return bool(req.node_selector)

    def check(self, req: PlacementRequest, node: NodeView) -> str | None:
        labels = node.labels
        for key, want in req.node_selector.items():
            if labels.get(key) != want:
                # Naming the first key that differs tells the user which label to fix; nodes
                # that miss the same key aggregate into one line of the unschedulable reason.
                return f"label {key} != {want}"
        return None
