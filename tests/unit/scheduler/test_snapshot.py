from __future__ import annotations

import dataclasses

import pytest

from orka.scheduler.snapshot import Layered, Snapshot
from tests.unit.scheduler.builders import node, request


def test_node_view_is_frozen() -> None:
    n = node()
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.cpu_used = 1  # type: ignore[misc]


def test_node_view_mappings_are_read_only_copies() -> None:
    labels = {"zone": "eu"}
    counts = {"web": 1}
    n = node(labels=labels, workload_counts=counts, drivers=["process"])
    labels["zone"] = "us"
    counts["web"] = 5
    assert n.labels == {"zone": "eu"}
    assert n.workload_counts == {"web": 1}
    assert n.drivers == frozenset({"process"})
    with pytest.raises(TypeError):
        n.labels["zone"] = "us"  # type: ignore[index]


def test_request_is_frozen_with_read_only_selector() -> None:
    selector = {"zone": "eu"}
    req = request(node_selector=selector)
    selector["zone"] = "us"
    assert req.node_selector == {"zone": "eu"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.cpu_millis = 1  # type: ignore[misc]


def test_snapshot_is_frozen_and_indexed_by_name() -> None:
    a, b = node(name="a"), node(name="b")
    snap = Snapshot([a, b])  # type: ignore[arg-type]
    assert snap.nodes == (a, b)
    assert snap.by_name["b"] is b
    assert len(snap) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.nodes = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.by_name["c"] = a  # type: ignore[index]


def test_snapshot_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="unique"):
        Snapshot((node(name="a"), node(name="a")))


def test_free_resources() -> None:
    n = node(cpu_allocatable=1000, cpu_used=300, mem_allocatable=10, mem_used=4)
    assert (n.cpu_free, n.mem_free) == (700, 6)


def test_a_layered_snapshot_equals_the_constructed_one() -> None:
    a, b, b2 = node(name="a"), node(name="b", cpu_used=100), node(name="b", cpu_used=200)
    snap = Snapshot.layered(Layered({"b": b, "a": a}, {"b": b2}))
    # The base's order, the top's views.
    assert snap == Snapshot((b2, a))
    assert snap.nodes == (b2, a)
    assert len(snap) == 2
    assert dict(snap.by_name) == {"a": a, "b": b2}
    assert "b" in snap.by_name and "c" not in snap.by_name
    assert snap.index is None
    with pytest.raises(TypeError):
        snap.by_name["c"] = a  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.index = None  # type: ignore[misc]
