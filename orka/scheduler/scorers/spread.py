"""Spread: prefer nodes with fewer instances of this workload, then the least allocated ones.

Raw value, higher is better: the mean free fraction of cpu and memory after placement (0..1),
minus 2 per instance of the workload already on the node. A difference of one instance (2)
outweighs the whole free-fraction range (1), so replicas spread across nodes first and only
then towards emptier nodes.
"""

from __future__ import annotations

from orka.scheduler.index import IndexedWalk, walk_spread
from orka.scheduler.snapshot import NodeView, PlacementRequest

# Must exceed the width of the free-fraction range (1.0) for replica count to dominate.
_PER_INSTANCE = 2.0


class SpreadScorer:
    __slots__ = ()
    name: str = "spread"
    # Least used first within a bucket; a node holding the workload is 2 (per instance) below.
    indexed: IndexedWalk | None = IndexedWalk(walk_spread, skips_holders=True)

    def score(self, req: PlacementRequest, node: NodeView) -> float:
        cpu_alloc = node.cpu_allocatable
        mem_alloc = node.mem_allocatable
        # A node that offers none of a resource has no free fraction of it to prefer.
        cpu_free = (cpu_alloc - node.cpu_used - req.cpu_millis) / cpu_alloc if cpu_alloc else 0.0
        mem_free = (mem_alloc - node.mem_used - req.memory_bytes) / mem_alloc if mem_alloc else 0.0
        free = (cpu_free + mem_free) * 0.5
        return free - _PER_INSTANCE * node.workload_counts.get(req.workload, 0)
