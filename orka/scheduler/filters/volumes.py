"""The volumes an instance uses must be usable on the node: a bound volume pins the instance to
the node its data lives on; an unbound one needs a node of its pool offering its backend, with
room for it."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class VolumesFilter:
    __slots__ = ()
    name: str = "volumes"
    # Pool, backends and volume space are not in the index's buckets: every node is asked.
    index_scope: IndexScope = "node"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.volumes)

    def applies(self, req: PlacementRequest) -> bool:
        # Most requests use no volume: they never pay for this.
        return bool(req.volumes)
