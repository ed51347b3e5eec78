"""Pools as the controller sees them: its node records grouped by the pool their agents joined,
and for each COMPUTE class how many more instances of it fit (IronCore's
availableMachineClasses, with counts).

Computed on each ListPools from the node records, whose `allocated` the scheduler republishes
at every usage report: nothing here is stored, so it can never disagree with the nodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from orka.models import (
    FAKE_DRIVER,
    KIND_DRIVER,
    Class,
    ClassCount,
    ComputeShape,
    Node,
    NodeState,
    Pool,
    Resources,
    WorkloadKind,
)


def _runs(node: Node, kinds: list[WorkloadKind]) -> bool:
    """The node has a driver for one of the kinds (empty: any kind); `fake` runs every kind."""
    drivers = set(node.drivers)
    if FAKE_DRIVER in drivers:
        return True
    wanted = kinds or list(WorkloadKind)
    return any(KIND_DRIVER[k] in drivers for k in wanted)


def _could_host(node: Node, shape: ComputeShape) -> bool:
    """Empty, the node could hold one instance of the class."""
    r, a = shape.resources, node.allocatable
    return (
        r.cpu_millis <= a.cpu_millis
        and r.memory_bytes <= a.memory_bytes
        and _runs(node, shape.kinds)
    )


def _takes_new(node: Node) -> bool:
    return (
        node.state is NodeState.READY
        and node.schedulable
        and not node.draining
        and not node.leaving
    )


def fits_now(node: Node, need: Resources) -> int:
    """How many more instances of `need` fit in what the node has free, over the dimensions
    `need` sets (at least one: a class has cpu or memory)."""
    free_cpu = max(0, node.allocatable.cpu_millis - node.allocated.cpu_millis)
    free_mem = max(0, node.allocatable.memory_bytes - node.allocated.memory_bytes)
    counts = []
    if need.cpu_millis:
        counts.append(free_cpu // need.cpu_millis)
    if need.memory_bytes:
        counts.append(free_mem // need.memory_bytes)
    return min(counts) if counts else 0


def available(nodes: list[Node], shape: ComputeShape) -> int | None:
    """How many more instances of the class fit on the pool's READY, schedulable nodes now;
    None when the pool does not support the class at all (no node of it could host one)."""
    if not any(_could_host(n, shape) for n in nodes):
        return None
    return sum(
        fits_now(n, shape.resources) for n in nodes if _takes_new(n) and _runs(n, shape.kinds)
    )


def compute_pools(nodes: Iterable[Node], classes: Iterable[Class]) -> list[Pool]:
    """Every pool some node joined, by name, with its COMPUTE classes by name."""
    by_pool: dict[str, list[Node]] = defaultdict(list)
    for n in nodes:
        by_pool[n.pool].append(n)
    compute = sorted(
        ((c.name, c.compute) for c in classes if c.compute is not None), key=lambda c: c[0]
    )
    pools = []
    for name in sorted(by_pool):
        members = by_pool[name]
        counts = []
        for class_name, shape in compute:
            count = available(members, shape)
            if count is not None:
                counts.append(ClassCount(class_name=class_name, count=count))
        pools.append(
            Pool(
                name=name,
                node_count=len(members),
                ready_node_count=sum(n.state is NodeState.READY for n in members),
                capacity=_sum(n.capacity for n in members),
                allocatable=_sum(n.allocatable for n in members),
                allocated=_sum(n.allocated for n in members),
                available_classes=counts,
                volume_capacity_bytes=sum(n.volume_capacity_bytes for n in members),
                volume_backends=sorted({b for n in members for b in n.volume_backends}),
            )
        )
    return pools


def _sum(values: Iterable[Resources]) -> Resources:
    cpu = mem = 0
    for r in values:
        cpu += r.cpu_millis
        mem += r.memory_bytes
    return Resources(cpu_millis=cpu, memory_bytes=mem)
