"""Reservation accounting in the scheduler's node registry."""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orka import fit
from orka.models import (
    HealthState,
    InstancePhase,
    InstanceReport,
    NodeState,
    PortBinding,
    PortProtocol,
    Resources,
)
from orka.scheduler.feed import Feed
from orka.scheduler.liveness import Liveness
from orka.scheduler.registry import Hold, NodeRecord, Registry
from tests.unit.scheduler.builders import GIB, request

SESSION = object()  # try_reserve only checks that a session is attached


def registry_with(**overrides: Any) -> tuple[Registry, NodeRecord]:
    reg = Registry()
    rec = reg.upsert(overrides.pop("name", "n1"))
    rec.allocatable = Resources(cpu_millis=4000, memory_bytes=8 * GIB)
    rec.capacity = rec.allocatable
    rec.session = SESSION  # type: ignore[assignment]
    rec.drivers = frozenset({"process"})
    for key, value in overrides.items():
        setattr(rec, key, value)
    return reg, rec


def report(name: str = "web-0", phase: InstancePhase = InstancePhase.RUNNING, **kw: Any):
    return InstanceReport(name=name, workload=kw.pop("workload", "web"), phase=phase, **kw)


RES = Resources(cpu_millis=500, memory_bytes=GIB)


# ---- NodeRecord holds ----


def test_add_hold_replaces_same_instance_instead_of_doubling() -> None:
    rec = NodeRecord(name="n1")
    rec.add_hold("a", Hold("web", 500, 100))
    rec.add_hold("a", Hold("web", 700, 300))
    assert (rec.cpu_used, rec.mem_used) == (700, 300)
    assert len(rec.holds) == 1


@pytest.mark.parametrize(
    ("holds", "drop", "expected_dropped", "expected_used"),
    [
        ([("a", 500, 100), ("b", 200, 50)], "a", True, (200, 50)),
        ([("a", 500, 100)], "missing", False, (500, 100)),
        ([("a", 500, 100), ("b", 200, 50)], "b", True, (500, 100)),
        ([], "a", False, (0, 0)),
    ],
)
def test_drop_hold_keeps_usage_exact(
    holds: list[tuple[str, int, int]],
    drop: str,
    expected_dropped: bool,
    expected_used: tuple[int, int],
) -> None:
    rec = NodeRecord(name="n1")
    for name, cpu, mem in holds:
        rec.add_hold(name, Hold("web", cpu, mem))
    assert rec.drop_hold(drop) is expected_dropped
    assert (rec.cpu_used, rec.mem_used) == expected_used
    # Dropping twice never goes negative.
    rec.drop_hold(drop)
    assert (rec.cpu_used, rec.mem_used) == expected_used


def test_used_always_equals_sum_of_holds_after_mixed_operations() -> None:
    rec = NodeRecord(name="n1")
    ops = [("add", "a", 100), ("add", "b", 200), ("add", "a", 50), ("drop", "b", 0),
           ("add", "c", 400), ("drop", "zz", 0), ("add", "b", 10), ("drop", "a", 0)]  # fmt: skip
    for op, name, cpu in ops:
        if op == "add":
            rec.add_hold(name, Hold("web", cpu, cpu * 2))
        else:
            rec.drop_hold(name)
        assert rec.cpu_used == sum(h.cpu_millis for h in rec.holds.values())
        assert rec.mem_used == sum(h.memory_bytes for h in rec.holds.values())
    assert set(rec.holds) == {"b", "c"}
    assert rec.cpu_used == 410


# ---- try_reserve ----


@pytest.mark.parametrize(
    ("node", "req", "reason"),
    [
        ({"session": None}, {}, "not ready"),
        ({"state": NodeState.NOT_READY}, {}, "not ready"),
        ({"state": NodeState.LOST}, {}, "lost"),
        ({"state": NodeState.LEFT}, {}, "left"),
        ({"schedulable": False}, {}, "cordoned"),
        ({"draining": True}, {}, "cordoned"),
        ({"drivers": frozenset({"containerd"})}, {}, "no process driver"),
        ({"labels": {"zone": "us"}}, {"node_selector": {"zone": "eu"}}, "label zone != eu"),
        ({}, {"cpu_millis": 4001}, "cpu request exceeds node capacity"),
        ({}, {"memory_bytes": 8 * GIB + 1}, "memory request exceeds node capacity"),
        ({"cpu_used": 3501}, {}, "insufficient cpu"),
        ({"mem_used": 7 * GIB + 1}, {}, "insufficient memory"),
        ({}, {"cpu_millis": 4000, "memory_bytes": 8 * GIB}, None),
        ({}, {"max_per_node": 1}, None),
    ],
)
def test_try_reserve_reasons(node: dict[str, Any], req: dict[str, Any], reason: str | None) -> None:
    reg, rec = registry_with(**node)
    r = request(**req)
    refused = reg.try_reserve(rec, r, hold_seconds=5)
    assert (refused and refused.message) == reason
    if reason is None:
        assert set(rec.holds) == {r.instance}
        assert rec.holds[r.instance].expires_at is not None
        assert (rec.cpu_used, rec.mem_used) == (r.cpu_millis, r.memory_bytes)
    else:
        assert rec.holds == {}
        assert (rec.cpu_used, rec.mem_used) == (node.get("cpu_used", 0), node.get("mem_used", 0))


def test_try_reserve_spread_counts_reservations_of_same_workload() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-0", max_per_node=2), 5) is None
    assert reg.try_reserve(rec, request(instance="web-1", max_per_node=2), 5) is None
    refused = reg.try_reserve(rec, request(instance="web-2", max_per_node=2), 5)
    assert refused is fit.spread_limit(2)
    assert refused.message == "spread: 2 replicas already on node"
    # Another workload is not limited by web's replicas.
    assert reg.try_reserve(rec, request(instance="db-0", workload="db", max_per_node=2), 5) is None
    assert set(rec.holds) == {"web-0", "web-1", "db-0"}


def test_try_reserve_counts_existing_usage() -> None:
    reg, rec = registry_with()
    rec.add_hold("other", Hold("x", 3800, 0))
    assert reg.try_reserve(rec, request(cpu_millis=201), 5) is fit.INSUFFICIENT_CPU
    assert reg.try_reserve(rec, request(cpu_millis=200), 5) is None
    assert rec.free() == (0, 8 * GIB - GIB)


@pytest.mark.parametrize(
    ("cpu", "mem", "expected"),
    [(500, GIB, 8), (300, GIB, 8), (1000, 1, 4), (1, 3 * GIB, 2), (4001, 1, 0)],
)
def test_reserve_until_refused_never_exceeds_allocatable(cpu: int, mem: int, expected: int) -> None:
    reg, rec = registry_with()
    accepted = 0
    for i in range(100):
        reason = reg.try_reserve(
            rec, request(instance=f"i-{i}", cpu_millis=cpu, memory_bytes=mem), 5
        )
        if reason is not None:
            # The last one that fits an empty node is refused for want of room, not capacity.
            expected_reasons = (fit.INSUFFICIENT_CPU, fit.INSUFFICIENT_MEMORY)
            if cpu > rec.allocatable.cpu_millis:
                expected_reasons = (fit.CPU_ABOVE_CAPACITY,)
            assert reason in expected_reasons
            break
        accepted += 1
    assert accepted == expected
    assert rec.cpu_used <= rec.allocatable.cpu_millis
    assert rec.mem_used <= rec.allocatable.memory_bytes
    assert rec.cpu_used == accepted * cpu
    assert rec.mem_used == accepted * mem


def test_release_frees_and_invalidates_snapshot() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="a"), 5) is None
    before = reg.snapshot()
    assert before.by_name["n1"].cpu_used == 500
    reg.release(rec, "a")
    after = reg.snapshot()
    assert after is not before
    assert after.by_name["n1"].cpu_used == 0
    assert rec.holds == {}
    # Releasing something unknown changes nothing, so the snapshot stays cached.
    reg.release(rec, "a")
    assert reg.snapshot() is after


# ---- expiry ----


def test_expire_reservations_drops_only_expired_unbound_holds() -> None:
    reg = Registry()
    now = time.monotonic()
    a = reg.upsert("a")
    b = reg.upsert("b")
    a.add_hold("expired", Hold("web", 100, 10, expires_at=now - 1))
    a.add_hold("fresh", Hold("web", 200, 20, expires_at=now + 60))
    a.add_hold("bound", Hold("web", 400, 40, expires_at=None))
    b.add_hold("expired-b", Hold("db", 1000, 100, expires_at=now - 0.5))
    snap = reg.snapshot()
    expired = reg.expire_reservations(now)
    assert sorted(expired) == [("a", "expired"), ("b", "expired-b")]
    assert set(a.holds) == {"fresh", "bound"}
    assert (a.cpu_used, a.mem_used) == (600, 60)
    assert (b.cpu_used, b.mem_used) == (0, 0)
    assert reg.snapshot() is not snap


def test_expire_reservations_without_expiry_keeps_snapshot() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(), hold_seconds=60) is None
    snap = reg.snapshot()
    assert reg.expire_reservations(time.monotonic()) == []
    assert reg.snapshot() is snap
    assert len(rec.holds) == 1


# ---- reports ----


def test_apply_report_turns_reservation_into_bound_hold() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-0"), 5) is None
    assert rec.holds["web-0"].expires_at is not None
    assert reg.apply_report(rec, report(phase=InstancePhase.STARTING), RES) is True
    assert rec.holds["web-0"].expires_at is None
    assert (rec.cpu_used, rec.mem_used) == (500, GIB)
    # A bound hold never expires.
    assert reg.expire_reservations(time.monotonic() + 1e6) == []


def test_apply_report_of_unknown_instance_creates_bound_hold() -> None:
    reg, rec = registry_with()
    snap = reg.snapshot()
    assert reg.apply_report(rec, report(name="x", workload="db"), RES) is True
    assert rec.holds["x"] == Hold("db", 500, GIB, expires_at=None)
    view = reg.snapshot().by_name["n1"]
    assert reg.snapshot() is not snap
    assert view.workload_counts == {"db": 1}
    assert view.cpu_used == 500


@pytest.mark.parametrize(
    "phase",
    [InstancePhase.SUCCEEDED, InstancePhase.FAILED, InstancePhase.STOPPED, InstancePhase.LOST],
)
def test_terminal_report_releases_hold(phase: InstancePhase) -> None:
    reg, rec = registry_with()
    reg.apply_report(rec, report(), RES)
    assert rec.cpu_used == 500
    assert reg.apply_report(rec, report(phase=phase), RES) is True
    assert rec.holds == {}
    assert (rec.cpu_used, rec.mem_used) == (0, 0)
    assert reg.snapshot().by_name["n1"].workload_counts == {}


@pytest.mark.parametrize(
    ("change", "differs"),
    [
        ({}, False),
        ({"phase": InstancePhase.STOPPING}, True),
        ({"restarts": 1}, True),
        ({"exit_code": 3}, True),
        ({"reason": "Crashed"}, True),
        ({"message": "boom"}, True),
        ({"started_at": 123.0}, False),  # times alone are not news
    ],
)
def test_apply_report_returns_true_only_when_report_differs(
    change: dict[str, Any], differs: bool
) -> None:
    reg, rec = registry_with()
    assert reg.apply_report(rec, report(), RES) is True
    assert reg.apply_report(rec, report(**change), RES) is differs
    # The newest report is what is remembered.
    assert rec.reports["web-0"] == report(**change)
    # Repeated non-terminal reports never double the hold.
    assert (rec.cpu_used, rec.mem_used) == (500, GIB)


def test_forget_drops_report_and_hold() -> None:
    reg, rec = registry_with()
    reg.apply_report(rec, report(), RES)
    reg.forget(rec, "web-0")
    assert rec.reports == {}
    assert rec.holds == {}
    assert rec.cpu_used == 0


def test_forget_of_an_instance_never_reported_frees_its_reservation() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-1"), 60) is None
    reg.forget(rec, "web-1")
    assert (rec.holds, rec.cpu_used, rec.reports) == ({}, 0, {})


# ---- snapshot ----


def test_snapshot_is_cached_until_changed() -> None:
    reg, rec = registry_with()
    first = reg.snapshot()
    assert reg.snapshot() is first
    rec.labels = {"zone": "a"}  # direct mutation is invisible until changed()
    assert reg.snapshot() is first
    assert dict(first.by_name["n1"].labels) == {}
    reg.changed()
    second = reg.snapshot()
    assert second is not first
    assert dict(second.by_name["n1"].labels) == {"zone": "a"}


def test_snapshot_reflects_holds_and_cordon() -> None:
    reg, rec = registry_with()
    other = reg.upsert("n2")
    other.draining = True
    for i in range(3):
        assert reg.try_reserve(rec, request(instance=f"web-{i}"), 5) is None
    assert reg.try_reserve(rec, request(instance="db-0", workload="db", cpu_millis=100), 5) is None
    snap = reg.snapshot()
    view = snap.by_name["n1"]
    assert dict(view.workload_counts) == {"web": 3, "db": 1}
    assert view.total_instances == 4
    assert (view.cpu_used, view.mem_used) == (1600, 4 * GIB)
    assert view.cpu_free == 2400
    assert snap.by_name["n2"].schedulable is False
    assert [n.name for n in snap.nodes] == ["n1", "n2"]


def test_upsert_returns_existing_record() -> None:
    reg, rec = registry_with()
    rec.add_hold("a", Hold("web", 1, 1))
    assert reg.upsert("n1") is rec
    assert reg.get("n1") is rec
    assert reg.get("nope") is None
    assert list(reg) == [rec]


def test_to_model_reports_allocated_from_holds() -> None:
    _, rec = registry_with(drivers=frozenset({"process", "fake"}))
    rec.add_hold("a", Hold("web", 300, 30))
    rec.add_hold("b", Hold("web", 200, 20))
    node = rec.to_model()
    assert node.allocated == Resources(cpu_millis=500, memory_bytes=50)
    assert node.instance_count == 2
    assert node.drivers == ["fake", "process"]


async def test_try_reserve_with_real_agent_session() -> None:
    from orka.scheduler.session import AgentSession

    reg, rec = registry_with(session=AgentSession("n1"))
    assert reg.try_reserve(rec, request(), 5) is None
    rec.session = None
    assert reg.try_reserve(rec, request(instance="web-1"), 5) is fit.NOT_READY


def test_report_binding_an_identical_reservation_keeps_the_snapshot() -> None:
    reg, rec = registry_with()
    req = request(instance="web-0", cpu_millis=500, memory_bytes=GIB)
    assert reg.try_reserve(rec, req, 5) is None
    snap = reg.snapshot()
    assert reg.apply_report(rec, report(phase=InstancePhase.STARTING), RES) is True
    assert rec.holds["web-0"] == Hold("web", 500, GIB, expires_at=None)
    # Nothing a view shows changed, so the cached snapshot (and its index) is still current.
    assert reg.snapshot() is snap
    assert reg.expire_reservations(time.monotonic() + 1e6) == []


def test_report_binding_a_different_reservation_rebuilds_the_view() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-0", cpu_millis=200), 5) is None
    snap = reg.snapshot()
    assert reg.apply_report(rec, report(phase=InstancePhase.STARTING), RES) is True
    assert rec.holds["web-0"] == Hold("web", 500, GIB, expires_at=None)
    fresh = reg.snapshot()
    assert fresh is not snap
    assert fresh.by_name["n1"].cpu_used == 500


def test_report_of_another_workload_rebinds_the_hold_to_it() -> None:
    """A reservation made for one workload but reported running another: the hold follows
    the report, so spread counts the workload the node really runs."""
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-0", workload="web"), 5) is None
    snap = reg.snapshot()
    assert reg.apply_report(rec, report(workload="db"), RES) is True
    assert rec.holds["web-0"] == Hold("db", 500, GIB, expires_at=None)
    fresh = reg.snapshot()
    assert fresh is not snap
    assert fresh.by_name["n1"].workload_counts == {"db": 1}


@pytest.mark.parametrize(("offset", "expired"), [(-0.001, True), (0.0, False), (0.001, False)])
def test_a_reservation_expires_only_once_its_time_has_passed(offset: float, expired: bool) -> None:
    reg, rec = registry_with()
    now = 1000.0
    rec.add_hold("web-0", Hold("web", 500, GIB, expires_at=now + offset))
    assert reg.expire_reservations(now) == ([("n1", "web-0")] if expired else [])
    assert ("web-0" in rec.holds) is not expired


def test_nodes_registered_between_snapshots_keep_registration_order() -> None:
    # The incremental snapshot gathers changed nodes from a set; nodes added together must still
    # come out in registration order (ranking ties are broken by that order).
    reg = Registry()
    reg.upsert("first")
    reg.snapshot()
    names = [f"node-{i:02d}" for i in range(20)]
    for name in names:
        reg.upsert(name)
    assert [v.name for v in reg.snapshot().nodes] == ["first", *names]
    more = [f"node-{i:02d}" for i in range(20, 40)]
    for name in more:
        reg.upsert(name)
    reg.upsert("first")  # an existing node changed in the same round keeps its place
    assert [v.name for v in reg.snapshot().nodes] == ["first", *names, *more]


def test_an_empty_registry_snapshots_no_nodes() -> None:
    snap = Registry().snapshot()
    assert snap.by_name == {}


def test_expire_reservations_looks_past_nodes_without_holds() -> None:
    # The liveness tick walks every node; one with nothing held must not end the walk.
    reg = Registry()
    now = time.monotonic()
    reg.upsert("empty")
    later = reg.upsert("later")
    later.add_hold("web-0", Hold("web", 100, 10, expires_at=now - 1))
    assert reg.expire_reservations(now) == [("later", "web-0")]
    assert later.holds == {}


# ---- incremental snapshots: a change rebuilds only the changed node's view ----


def _reserve(reg: Registry, rec: NodeRecord) -> None:
    assert reg.try_reserve(rec, request(instance="web-1"), 5) is None


def _release(reg: Registry, rec: NodeRecord) -> None:
    reg.release(rec, "web-0")


def _report_new(reg: Registry, rec: NodeRecord) -> None:
    assert reg.apply_report(rec, report("web-9"), RES) is True


def _upsert_again(reg: Registry, rec: NodeRecord) -> None:
    assert reg.upsert(rec.name) is rec


@pytest.mark.parametrize(
    ("change", "n1_cpu_used"),
    [(_reserve, 1000), (_release, 0), (_report_new, 1000), (_upsert_again, 500)],
    ids=["try_reserve", "release", "apply_report", "upsert"],
)
def test_a_change_to_one_node_reuses_the_other_views(change: Any, n1_cpu_used: int) -> None:
    reg, rec = registry_with()
    reg.upsert("n2")
    assert reg.try_reserve(rec, request(instance="web-0"), 5) is None
    for _ in range(2):  # the second snapshot onward carries an index over
        first = reg.snapshot()
        change(reg, rec)
        second = reg.snapshot()
        assert second is not first
        assert second.by_name["n2"] is first.by_name["n2"]
        assert second.by_name["n1"] is not first.by_name["n1"]
        assert second.by_name["n1"].cpu_used == n1_cpu_used
        reg.changed(rec)  # back to a state where the change applies again
        if change is _release:
            assert reg.try_reserve(rec, request(instance="web-0"), 5) is None
        elif change is _reserve:
            reg.release(rec, "web-1")
        elif change is _report_new:
            reg.forget(rec, "web-9")


def test_a_change_to_anything_rebuilds_every_view_and_the_index() -> None:
    reg, rec = registry_with()
    reg.upsert("n2")
    reg.snapshot()
    _reserve(reg, rec)
    first = reg.snapshot()
    assert first.index is not None
    reg.changed()
    second = reg.snapshot()
    assert second.by_name["n2"] is not first.by_name["n2"]
    assert second.index is not None
    assert [v.name for v in second.nodes] == ["n1", "n2"]


@pytest.mark.parametrize("seen", [True, False], ids=["in-last-snapshot", "added-since"])
def test_a_node_removed_from_the_registry_leaves_the_snapshot(seen: bool) -> None:
    reg, _ = registry_with()
    reg.upsert("n2")
    reg.snapshot()
    gone = reg.upsert("gone")
    if seen:
        reg.snapshot()
    del reg.nodes["gone"]
    reg.changed(gone)
    assert [v.name for v in reg.snapshot().nodes] == ["n1", "n2"]
    assert "gone" not in reg.snapshot().by_name


# ---- host ports: a node resource held and freed like cpu and memory ----

HTTP = (8080, PortProtocol.TCP)
DNS = (53, PortProtocol.UDP)


def _ports(reg: Registry) -> frozenset[fit.HostPort]:
    return reg.snapshot().by_name["n1"].host_ports


def test_a_reserved_host_port_refuses_the_next_reservation_until_released() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-0", host_ports={HTTP}), 60) is None
    assert _ports(reg) == {HTTP}
    # Another instance (of any workload) wanting the same port is refused; another port is not.
    refused = reg.try_reserve(rec, request(instance="api-0", workload="api", host_ports={HTTP}), 60)
    assert refused is fit.host_port_in_use(*HTTP)
    assert str(refused) == "host port 8080 in use"
    assert reg.try_reserve(rec, request(instance="dns-0", host_ports={DNS}), 60) is None
    assert _ports(reg) == {HTTP, DNS}
    reg.release(rec, "web-0")
    assert _ports(reg) == {DNS}
    assert reg.try_reserve(rec, request(instance="api-0", host_ports={HTTP}), 60) is None


@pytest.mark.parametrize(
    "free",
    ["release", "forget", "expire", "terminal-report"],
)
def test_every_way_a_hold_ends_frees_its_host_ports(free: str) -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-0", host_ports={HTTP, DNS}), 5) is None
    # Bound or not, each way out frees the ports (expiry only frees an unbound reservation).
    if free != "expire":
        reg.apply_report(rec, report(phase=InstancePhase.RUNNING), RES)
        assert rec.holds["web-0"].expires_at is None
        assert _ports(reg) == {HTTP, DNS}
    if free == "release":
        reg.release(rec, "web-0")
    elif free == "forget":
        reg.forget(rec, "web-0")
    elif free == "expire":
        assert reg.expire_reservations(time.monotonic() + 10) == [("n1", "web-0")]
    else:
        reg.apply_report(rec, report(phase=InstancePhase.STOPPED), RES)
    assert (rec.port_users, _ports(reg)) == ({}, frozenset())
    assert reg.try_reserve(rec, request(instance="web-1", host_ports={HTTP, DNS}), 5) is None


def test_ports_an_agent_reports_bound_count_beside_the_fixed_ones() -> None:
    reg, rec = registry_with()
    assert reg.try_reserve(rec, request(instance="web-0", host_ports={HTTP}), 60) is None
    # The agent picked 31000 for a host_port 0 port and reports both bindings.
    bound = [
        PortBinding(name="http", port=8080, host_port=8080),
        PortBinding(name="admin", port=9000, host_port=31000),
        PortBinding(name="none", port=9001, host_port=0),  # not bound on the host
    ]
    reg.apply_report(rec, report(phase=InstancePhase.RUNNING, ports=bound), RES)
    assert _ports(reg) == {HTTP, (31000, PortProtocol.TCP)}
    assert rec.holds["web-0"].expires_at is None
    assert (rec.cpu_used, rec.mem_used) == (500, GIB)
    got = reg.try_reserve(rec, request(instance="x-0", host_ports={(31000, PortProtocol.TCP)}), 1)
    assert str(got) == "host port 31000 in use"
    # The same report again changes nothing; the instance's end frees every port it bound.
    snap = reg.snapshot()
    reg.apply_report(rec, report(phase=InstancePhase.RUNNING, ports=bound), RES)
    assert reg.snapshot() is snap
    reg.apply_report(rec, report(phase=InstancePhase.SUCCEEDED, ports=bound), RES)
    assert _ports(reg) == frozenset()


def test_an_instance_reported_by_a_node_the_scheduler_did_not_place_holds_its_ports() -> None:
    # After a scheduler restart agents re-announce what runs: its reported ports are taken.
    reg, rec = registry_with()
    bound = [PortBinding(name="dns", port=53, host_port=53, protocol=PortProtocol.UDP)]
    reg.apply_report(rec, report(name="dns-0", ports=bound), RES)
    assert rec.holds["dns-0"] == Hold("web", 500, GIB, host_ports=frozenset({DNS}))
    assert reg.try_reserve(rec, request(host_ports={DNS}), 1) is fit.host_port_in_use(*DNS)


def test_two_holds_on_one_port_free_it_only_when_both_end() -> None:
    # Only agents' reports can make this (two instances said to bind one port): the port stays
    # taken until the last of them ends.
    rec = NodeRecord(name="n1")
    rec.add_hold("a", Hold("web", 0, 0, host_ports=frozenset({HTTP})))
    rec.add_hold("b", Hold("web", 0, 0, host_ports=frozenset({HTTP, DNS})))
    assert rec.host_ports == {HTTP, DNS}
    rec.drop_hold("b")
    assert rec.host_ports == {HTTP}
    rec.add_hold("a", Hold("web", 0, 0))  # replaced by a hold without ports
    assert (rec.host_ports, rec.port_users) == (frozenset(), {})


def test_a_lost_node_frees_its_host_ports() -> None:
    reg, rec = registry_with()
    reg.apply_report(rec, report(name="web-0", ports=[PortBinding(name="h", host_port=8080)]), RES)
    assert reg.try_reserve(rec, request(instance="web-1", host_ports={DNS}), 60) is None
    liveness = Liveness(reg, Feed(reg, 1.0), 1.0, node_lost_after=5.0, clock=time.monotonic)
    rec.session = None  # its stream is gone
    rec.last_seen = time.monotonic() - 6
    liveness.check(time.monotonic())
    assert rec.state is NodeState.LOST
    assert (rec.port_users, rec.holds) == ({}, {})


def test_a_change_of_health_alone_is_a_change_to_pass_on() -> None:
    reg, rec = registry_with()
    reg.apply_report(rec, report(), RES)
    assert reg.apply_report(rec, report(), RES) is False
    healthy = report(health=HealthState.HEALTHY, health_changed_at=10.0)
    assert reg.apply_report(rec, healthy, RES) is True
    assert reg.apply_report(rec, healthy, RES) is False
    failing = report(health=HealthState.UNHEALTHY, health_message="refused", health_changed_at=20)
    assert reg.apply_report(rec, failing, RES) is True
    assert reg.apply_report(rec, failing.model_copy(update={"health_message": "404"}), RES)


# ---- snapshots share views: every one shows the registry as it was when taken ----


@pytest.mark.parametrize("rebase_at", [None, 2], ids=["real-bound", "rebase-often"])
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([*["reserve"] * 3, "release", "add", "remove", "everything", "look"]),
            st.integers(0, 29),
        ),
        min_size=20,
        max_size=120,
    ),
)
def test_each_snapshot_shows_the_records_as_they_were_when_it_was_taken(
    rebase_at: int | None, steps: list[tuple[str, int]]
) -> None:
    """Whatever order of reservations, releases, nodes coming and going and full rebuilds,
    a snapshot equals one built afresh from every record at that moment, in registration
    order, and no later change shows through an earlier snapshot (they share views). With
    `rebase_at`, snapshots take a new base after that many changed views (most runs of changes
    end in a node coming or going before the real bound)."""
    if rebase_at is None:
        _follow(steps)
    else:
        with mock.patch("orka.scheduler.registry._rebase_at", lambda nodes: rebase_at):
            _follow(steps)


def _follow(steps: list[tuple[str, int]]) -> None:
    reg = Registry()
    taken: list[tuple[Any, tuple[Any, ...]]] = []
    for i in range(20):
        _, rec = registry_with(name=f"n{i:02d}")
        reg.nodes[rec.name] = rec
        reg.changed(rec)
    for step, (what, k) in enumerate(steps):
        name = f"n{k:02d}"
        rec = reg.nodes.get(name)
        if what == "reserve" and rec is not None:
            reg.try_reserve(rec, request(instance=f"i{step}", cpu_millis=10), 5)
        elif what == "release" and rec is not None and rec.holds:
            reg.release(rec, next(iter(rec.holds)))
        elif what == "add" and rec is None:
            _, rec = registry_with(name=name)
            reg.nodes[name] = rec
            reg.changed(rec)
        elif what == "remove" and rec is not None:
            del reg.nodes[name]
            reg.changed(rec)
        elif what == "everything":
            reg.changed()
        snap = reg.snapshot()
        fresh = tuple(r.view() for r in reg.nodes.values())
        assert snap.nodes == fresh
        assert dict(snap.by_name) == {v.name: v for v in fresh}
        assert list(snap.by_name) == list(reg.nodes)
        taken.append((snap, fresh))
    for snap, fresh in taken:
        assert snap.nodes == fresh
        assert tuple(snap.by_name[v.name] for v in fresh) == fresh
