"""Small builders: a sensible default node and request, changed only where a test cares."""

from __future__ import annotations

from typing import Any

from orka.models import NodeState, WorkloadKind
from orka.scheduler.snapshot import NodeView, PlacementRequest, Snapshot

GIB = 1 << 30


def node(**overrides: Any) -> NodeView:
    fields: dict[str, Any] = {
        "name": "n1",
        "state": NodeState.READY,
        "schedulable": True,
        "drivers": frozenset({"process"}),
        "labels": {},
        "cpu_allocatable": 4000,
        "mem_allocatable": 8 * GIB,
        "cpu_used": 0,
        "mem_used": 0,
        "workload_counts": {},
        "total_instances": 0,
    }
    fields.update(overrides)
    return NodeView(**fields)


def request(**overrides: Any) -> PlacementRequest:
    fields: dict[str, Any] = {
        "instance": "web-0",
        "workload": "web",
        "kind": WorkloadKind.PROCESS,
        "cpu_millis": 500,
        "memory_bytes": GIB,
        "node_selector": {},
        "max_per_node": 0,
    }
    fields.update(overrides)
    return PlacementRequest(**fields)


def snapshot(*nodes: NodeView) -> Snapshot:
    return Snapshot(nodes)
