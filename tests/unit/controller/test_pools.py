"""ListPools' arithmetic: which COMPUTE classes a pool supports and how many more fit now."""

from __future__ import annotations

from typing import Any

import pytest

from orka.controller.pools import compute_pools
from orka.models import Class, Node, NodeState, Resources

GI = 1 << 30


def node(name: str, pool: str = "default", **kw: Any) -> Node:
    data: dict[str, Any] = {
        "name": name,
        "pool": pool,
        "drivers": ["process"],
        "capacity": Resources(cpu_millis=4000, memory_bytes=8 * GI),
        "allocatable": Resources(cpu_millis=4000, memory_bytes=8 * GI),
    }
    data.update(kw)
    return Node(**data)


def compute(name: str, cpu: int = 0, memory: int = 0, kinds: tuple[str, ...] = ()) -> Class:
    return Class.model_validate(
        {
            "name": name,
            "compute": {
                "resources": {"cpu_millis": cpu, "memory_bytes": memory},
                "kinds": list(kinds),
            },
        }
    )


SMALL = compute("small", 1000, GI)


@pytest.mark.parametrize(
    ("nodes", "classes", "want"),
    [
        # min over the dimensions the class sets: 4 by cpu, 8 by memory.
        ([node("a")], [SMALL], {"small": 4}),
        # A class that sets only memory counts by memory alone.
        ([node("a")], [compute("mem", memory=3 * GI)], {"mem": 2}),
        # What is allocated is not free; an overcommitted node counts 0, never less.
        ([node("a", allocated=Resources(cpu_millis=2500))], [SMALL], {"small": 1}),
        ([node("a", allocated=Resources(cpu_millis=9000)), node("b")], [SMALL], {"small": 4}),
        # Supported (a node could host it empty) but nothing fits on nodes taking new ones.
        ([node("a", state=NodeState.NOT_READY)], [SMALL], {"small": 0}),
        ([node("a", schedulable=False), node("b", draining=True)], [SMALL], {"small": 0}),
        ([node("a", leaving=True), node("b")], [SMALL], {"small": 4}),
        # Not supported at all: too big for every node, or no driver for its kinds.
        ([node("a")], [compute("huge", 5000)], {}),
        ([node("a")], [compute("vm", 1000, kinds=("VM",))], {}),
        ([node("a", drivers=["fake"])], [compute("vm", 1000, kinds=("VM",))], {"vm": 4}),
        # Only the nodes that run a kind of the class count.
        (
            [node("a", drivers=["libvirt"]), node("b")],
            [compute("vm", 1000, kinds=("VM",))],
            {"vm": 4},
        ),
        # VOLUME classes are no compute shape.
        (
            [node("a")],
            [Class.model_validate({"name": "fast", "volume": {}})],
            {},
        ),
    ],
)
def test_available_classes(nodes: list[Node], classes: list[Class], want: dict[str, int]) -> None:
    [pool] = compute_pools(nodes, classes)
    assert {c.class_name: c.count for c in pool.available_classes} == want


def test_pools_group_nodes_and_sum_them() -> None:
    nodes = [
        node("a", "big", volume_backends=["ext4"], volume_capacity_bytes=GI),
        node("b", "big", state=NodeState.LOST, volume_backends=["ext4", "qcow2"]),
        node("c", allocated=Resources(cpu_millis=500, memory_bytes=GI)),
    ]
    big, default = compute_pools(nodes, [SMALL, compute("a-first", 100)])
    assert (big.name, big.node_count, big.ready_node_count) == ("big", 2, 1)
    assert big.capacity == Resources(cpu_millis=8000, memory_bytes=16 * GI)
    assert (big.volume_backends, big.volume_capacity_bytes) == (["ext4", "qcow2"], GI)
    assert [c.class_name for c in big.available_classes] == ["a-first", "small"]
    assert default.allocated == Resources(cpu_millis=500, memory_bytes=GI)
    assert [(c.class_name, c.count) for c in default.available_classes] == [
        ("a-first", 35),
        ("small", 3),
    ]
