"""Binpack: prefer the most allocated nodes, so whole nodes stay free for big instances.

Raw value, higher is better: the mean allocated fraction of cpu and memory after placement.
"""

from __future__ import annotations

from orka.scheduler.index import IndexedWalk, walk_binpack
from orka.scheduler.snapshot import NodeView, PlacementRequest


class BinpackScorer:
    __slots__ = ()
    name: str = "binpack"
    # Most used (that may still fit) first within a bucket.
    indexed: IndexedWalk | None = IndexedWalk(walk_binpack)

    def score(self, req: PlacementRequest, node: NodeView) -> float:
        cpu_alloc = node.cpu_allocatable
        mem_alloc = node.mem_allocatable
        # As in spread, a resource the node does not offer counts as full, not as a division error.
        cpu = (node.cpu_used + req.cpu_millis) / cpu_alloc if cpu_alloc else 1.0
        mem = (node.mem_used + req.memory_bytes) / mem_alloc if mem_alloc else 1.0
        return (cpu + mem) * 0.5
