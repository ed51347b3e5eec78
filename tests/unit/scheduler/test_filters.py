from __future__ import annotations

from typing import Any

import pytest

from orka.fit import VolumeNeed
from orka.models import NodeState, PortProtocol, WorkloadKind
from orka.scheduler.filters import FILTERS
from orka.scheduler.filters.driver import DriverFilter
from orka.scheduler.filters.host_ports import HostPortsFilter
from orka.scheduler.filters.node_selector import NodeSelectorFilter
from orka.scheduler.filters.pool import ClassFilter, PoolFilter
from orka.scheduler.filters.ready import ReadyFilter
from orka.scheduler.filters.resources import ResourcesFilter
from orka.scheduler.filters.schedulable import SchedulableFilter
from orka.scheduler.filters.spread import SpreadFilter
from orka.scheduler.filters.volumes import VolumesFilter
from tests.unit.scheduler.builders import GIB, node, request

TCP, UDP = PortProtocol.TCP, PortProtocol.UDP
MIB = 1 << 20
# A node that can create volumes: pool "fast", ext4 only, 1 GiB of volume space.
VOLUME_NODE = {
    "name": "node-1",
    "pool": "fast",
    "volume_backends": frozenset({"ext4"}),
    "volume_capacity_bytes": GIB,
}


def vols(*needs: VolumeNeed) -> dict[str, Any]:
    return {"volumes": needs}


def vol(name: str = "data-1", size: int = 64 * MIB, **fields: Any) -> VolumeNeed:
    return VolumeNeed(name=name, size_bytes=size, backend=fields.pop("backend", "ext4"), **fields)


CASES: list[tuple[str, Any, dict[str, Any], dict[str, Any], str | None]] = [
    # id, filter, node overrides, request overrides, expected reason
    ("ready", ReadyFilter(), {}, {}, None),
    ("not-ready", ReadyFilter(), {"state": NodeState.NOT_READY}, {}, "not ready"),
    ("lost", ReadyFilter(), {"state": NodeState.LOST}, {}, "lost"),
    ("left", ReadyFilter(), {"state": NodeState.LEFT}, {}, "left"),
    ("schedulable", SchedulableFilter(), {}, {}, None),
    ("cordoned", SchedulableFilter(), {"schedulable": False}, {}, "cordoned"),
    ("driver-process", DriverFilter(), {}, {}, None),
    (
        "driver-container",
        DriverFilter(),
        {"drivers": frozenset({"containerd"})},
        {"kind": WorkloadKind.CONTAINER},
        None,
    ),
    (
        "driver-fake-serves-vm",
        DriverFilter(),
        {"drivers": frozenset({"fake"})},
        {"kind": WorkloadKind.VM},
        None,
    ),
    (
        "no-libvirt",
        DriverFilter(),
        {"drivers": frozenset({"process", "containerd"})},
        {"kind": WorkloadKind.VM},
        "no libvirt driver",
    ),
    (
        "no-containerd",
        DriverFilter(),
        {},
        {"kind": WorkloadKind.CONTAINER},
        "no containerd driver",
    ),
    ("no-drivers", DriverFilter(), {"drivers": frozenset()}, {}, "no process driver"),
    ("pool-any", PoolFilter(), {"pool": "gpu"}, {}, None),
    ("pool-same", PoolFilter(), {"pool": "gpu"}, {"pool": "gpu"}, None),
    ("pool-other", PoolFilter(), {"pool": "default"}, {"pool": "gpu"}, "node is in pool default"),
    ("class-fits", ClassFilter(), {}, {"class_name": "small", "cpu_millis": 4000}, None),
    (
        "class-too-big",
        ClassFilter(),
        {},
        {"class_name": "large", "cpu_millis": 4001},
        "cannot host class large",
    ),
    # A full node is not the class's fault: the resources filter says so, and waiting helps.
    ("class-node-full", ClassFilter(), {"cpu_used": 4000}, {"class_name": "small"}, None),
    ("no-volumes", VolumesFilter(), {}, {}, None),
    ("volume-bound-here", VolumesFilter(), VOLUME_NODE, vols(vol(node="node-1")), None),
    # Bound: only its node counts, whatever pool, backends or room this node has.
    (
        "volume-bound-here-no-room",
        VolumesFilter(),
        {"name": "node-1"},
        vols(vol(node="node-1")),
        None,
    ),
    (
        "volume-elsewhere",
        VolumesFilter(),
        VOLUME_NODE,
        vols(vol(node="node-2")),
        "volume data-1 lives on node-2",
    ),
    ("volume-unbound-fits", VolumesFilter(), VOLUME_NODE, vols(vol(pool="fast")), None),
    ("volume-any-pool", VolumesFilter(), VOLUME_NODE, vols(vol()), None),
    (
        "volume-other-pool",
        VolumesFilter(),
        VOLUME_NODE,
        vols(vol(pool="slow")),
        "volume data-1 needs pool slow",
    ),
    (
        "volume-no-backend",
        VolumesFilter(),
        VOLUME_NODE,
        vols(vol(backend="qcow2")),
        "no qcow2 volumes on this node",
    ),
    ("volume-no-backends-at-all", VolumesFilter(), {}, vols(vol()), "no ext4 volumes on this node"),
    ("volume-exactly-capacity", VolumesFilter(), VOLUME_NODE, vols(vol(size=GIB)), None),
    (
        "volume-too-big",
        VolumesFilter(),
        VOLUME_NODE,
        vols(vol(size=GIB + 1)),
        "volume data-1 is larger than the node's volume space",
    ),
    (
        "volume-second-one-rules-out",
        VolumesFilter(),
        VOLUME_NODE,
        vols(vol(node="node-1"), vol("logs", node="node-3")),
        "volume logs lives on node-3",
    ),
    ("fits", ResourcesFilter(), {}, {}, None),
    (
        "fits-exactly",
        ResourcesFilter(),
        {"cpu_used": 3500, "mem_used": 7 * GIB},
        {},
        None,
    ),
    ("cpu", ResourcesFilter(), {"cpu_used": 3501}, {}, "insufficient cpu"),
    ("memory", ResourcesFilter(), {"mem_used": 7 * GIB + 1}, {}, "insufficient memory"),
    (
        "cpu-named-first",
        ResourcesFilter(),
        {"cpu_used": 4000, "mem_used": 8 * GIB},
        {},
        "insufficient cpu",
    ),
    (
        "overcommitted-zero-request",
        ResourcesFilter(),
        {"cpu_used": 4001},
        {"cpu_millis": 0, "memory_bytes": 0},
        "insufficient cpu",
    ),
    ("no-selector", NodeSelectorFilter(), {"labels": {"zone": "eu"}}, {}, None),
    (
        "selector-match",
        NodeSelectorFilter(),
        {"labels": {"zone": "eu", "disk": "ssd"}},
        {"node_selector": {"zone": "eu"}},
        None,
    ),
    (
        "selector-wrong-value",
        NodeSelectorFilter(),
        {"labels": {"zone": "us"}},
        {"node_selector": {"zone": "eu"}},
        "label zone != eu",
    ),
    (
        "selector-missing-key",
        NodeSelectorFilter(),
        {"labels": {"zone": "eu"}},
        {"node_selector": {"zone": "eu", "disk": "ssd"}},
        "label disk != ssd",
    ),
    ("no-spread-limit", SpreadFilter(), {"workload_counts": {"web": 9}}, {}, None),
    (
        "under-limit",
        SpreadFilter(),
        {"workload_counts": {"web": 1}},
        {"max_per_node": 2},
        None,
    ),
    (
        "other-workload-ignored",
        SpreadFilter(),
        {"workload_counts": {"db": 5}},
        {"max_per_node": 1},
        None,
    ),
    (
        "limit-reached",
        SpreadFilter(),
        {"workload_counts": {"web": 2}},
        {"max_per_node": 2},
        "spread: 2 replicas already on node",
    ),
    (
        "limit-reached-singular",
        SpreadFilter(),
        {"workload_counts": {"web": 1}},
        {"max_per_node": 1},
        "spread: 1 replica already on node",
    ),
    ("no-host-ports-asked", HostPortsFilter(), {"host_ports": {(8080, TCP)}}, {}, None),
    ("host-port-free", HostPortsFilter(), {}, {"host_ports": {(8080, TCP)}}, None),
    (
        "host-port-taken",
        HostPortsFilter(),
        {"host_ports": {(8080, TCP)}},
        {"host_ports": {(8080, TCP)}},
        "host port 8080 in use",
    ),
    (
        "udp-host-port-taken",
        HostPortsFilter(),
        {"host_ports": {(53, UDP), (80, TCP)}},
        {"host_ports": {(53, UDP)}},
        "host port 53/udp in use",
    ),
    # tcp and udp are two ports: a DNS server on udp leaves tcp 53 free.
    (
        "other-protocol-free",
        HostPortsFilter(),
        {"host_ports": {(53, UDP)}},
        {"host_ports": {(53, TCP)}},
        None,
    ),
    (
        "neighbour-port-free",
        HostPortsFilter(),
        {"host_ports": {(8079, TCP), (8081, TCP)}},
        {"host_ports": {(8080, TCP)}},
        None,
    ),
    # Several taken: the lowest is named, whatever order the sets iterate in.
    (
        "lowest-taken-named",
        HostPortsFilter(),
        {"host_ports": {(9000, TCP), (443, UDP), (443, TCP), (80, UDP)}},
        {"host_ports": {(9000, TCP), (443, TCP), (443, UDP), (8080, TCP)}},
        "host port 443 in use",
    ),
]


@pytest.mark.parametrize(
    ("flt", "node_overrides", "req_overrides", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_filter(
    flt: Any, node_overrides: dict[str, Any], req_overrides: dict[str, Any], expected: str | None
) -> None:
    req = request(**req_overrides)
    n = node(**node_overrides)
    # A filter that does not apply must be one that would pass anyway.
    result = flt.check(req, n) if flt.applies(req) else None
    assert (result and result.message) == expected
    # Each filter is its aspect of the one rule: the same reason object as orka.fit gives.
    assert flt.check(req, n) == result


@pytest.mark.parametrize(
    ("req_overrides", "expected"),
    [
        ({}, {"node_selector": False, "spread": False, "host_ports": False}),
        (
            {"node_selector": {"zone": "eu"}},
            {"node_selector": True, "spread": False, "host_ports": False},
        ),
        ({"max_per_node": 1}, {"node_selector": False, "spread": True, "host_ports": False}),
        (
            {"host_ports": {(8080, TCP)}},
            {"node_selector": False, "spread": False, "host_ports": True},
        ),
    ],
)
def test_optional_filters_apply_only_when_asked(
    req_overrides: dict[str, Any], expected: dict[str, bool]
) -> None:
    req = request(**req_overrides)
    applies = {f.name: f.applies(req) for f in FILTERS}
    for name, want in expected.items():
        assert applies[name] is want
    assert all(applies[name] for name in ("ready", "schedulable", "driver", "resources"))
    assert applies["volumes"] is bool(req.volumes)


def test_filter_table_is_explicit_and_ordered() -> None:
    assert [f.name for f in FILTERS] == [
        "ready",
        "schedulable",
        "pool",
        "driver",
        "class",
        "resources",
        "node_selector",
        "host_ports",
        "spread",
        "volumes",
    ]


def test_request_sized_exactly_to_free_memory_fits() -> None:
    req = request(cpu_millis=0, memory_bytes=GIB)
    assert ResourcesFilter().check(req, node(mem_allocatable=GIB)) is None
