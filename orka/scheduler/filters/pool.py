"""A workload that names a pool goes only to nodes of that pool; one of a COMPUTE class only
to nodes that could hold the class empty (the reason names the class)."""

from __future__ import annotations

from orka import fit
from orka.scheduler.snapshot import IndexScope, PlacementRequest


class PoolFilter:
    __slots__ = ()
    name: str = "pool"
    # The index does not group nodes by pool: every node it yields is checked.
    index_scope: IndexScope = "node"
    # The rule's own aspect, not a wrapper around it: one call per node checked.
    check = staticmethod(fit.pool)

    def applies(self, req: PlacementRequest) -> bool:
        return bool(req.pool)


class ClassFilter:
    __slots__ = ()
    name: str = "class"
    # Its verdict depends only on a node's allocatable, which a bucket's nodes share.
    index_scope: IndexScope = "bucket"
    check = staticmethod(fit.class_fit)

    def applies(self, req: PlacementRequest) -> bool:
        return bool(req.class_name)
