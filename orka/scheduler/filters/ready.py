"""Only READY nodes take new instances; the reason says which other state the node is in."""

from __future__ import annotations

from orka.models import NodeState
from orka.scheduler.snapshot import NodeView, PlacementRequest

_REASONS: dict[NodeState, str] = {
    NodeState.NOT_READY: "not ready",
    NodeState.LOST: "lost",
    NodeState.LEFT: "left",
}


class ReadyFilter:
    __slots__ = ()
    name: str = "ready"

    def applies(self, req: PlacementRequest) -> bool:
        return True

    def check(self, req: PlacementRequest, node: NodeView) -> str | None:
        state = node.state
        if state is NodeState.READY:
            return None
        # A state added later must still reject, with a reason that names it.
        return _REASONS.get(state) or state.value.lower().replace("_", " ")
