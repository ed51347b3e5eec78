"""A fixed host port the request binds must not be taken on the node already."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class HostPortsFilter:
    __slots__ = ()
    name: str = "host_ports"
    # The index orders nodes by cpu and memory only: every node it yields is checked.
    index_scope: IndexScope = "node"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.host_ports)

    def applies(self, req: PlacementRequest) -> bool:
        # Most requests fix no host port (0: the agent picks one): they never pay for this.
        return bool(req.host_ports)
