"""The placement filters, in the order the pipeline runs them.

A node is rejected by the first filter that returns a reason, so the order is both a cost order
(cheap attribute checks first, they also remove the most nodes) and the precedence of reasons
users see: a lost node reports "lost", not "insufficient cpu". Each filter is one aspect of
`orka.fit`'s rule, in the same order as `fit.fit`, so ranking and reserving agree on every node.
"""

from __future__ import annotations

from typing import Protocol

from orka import fit
from orka.scheduler.filters.driver import DriverFilter
from orka.scheduler.filters.host_ports import HostPortsFilter
from orka.scheduler.filters.node_selector import NodeSelectorFilter
from orka.scheduler.filters.pool import ClassFilter, PoolFilter
from orka.scheduler.filters.ready import ReadyFilter
from orka.scheduler.filters.resources import ResourcesFilter
from orka.scheduler.filters.schedulable import SchedulableFilter
from orka.scheduler.filters.spread import SpreadFilter
from orka.scheduler.filters.volumes import VolumesFilter
from orka.scheduler.snapshot import IndexScope, NodeView, PlacementRequest


class Filter(Protocol):
    name: str
    # What the indexed stage (orka.scheduler.indexed) must still ask of this filter: nothing
    # ("passed": the index holds only nodes it passes), once per bucket ("bucket": its verdict
    # depends only on what a bucket's nodes share, their drivers and allocatable), or of every
    # node it looks at ("node").
    index_scope: IndexScope

    def applies(self, req: PlacementRequest) -> bool:
        """False when the request cannot be rejected by this filter, so it is skipped."""
        ...

    def check(self, req: PlacementRequest, node: NodeView) -> fit.Reason | None:
        """The reason the node cannot take the request, or None when it can."""
        ...


FILTERS: tuple[Filter, ...] = (
    ReadyFilter(),
    SchedulableFilter(),
    PoolFilter(),
    DriverFilter(),
    ClassFilter(),
    ResourcesFilter(),
    NodeSelectorFilter(),
    HostPortsFilter(),
    SpreadFilter(),
    VolumesFilter(),
)

__all__ = ["FILTERS", "Filter"]
