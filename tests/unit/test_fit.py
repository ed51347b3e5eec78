"""The one "does this instance fit this node" rule, its reasons, and the four places that ask it."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orka import fit
from orka.agent.admission import Admission, Reservation
from orka.models import NodeState, PortProtocol, PortSpec, Resources, WorkloadKind, WorkloadSpec
from orka.rpc.place_reasons import place_result_to_pb, reasons_from_pb
from orka.scheduler.filters import FILTERS
from orka.scheduler.index import SnapshotIndex
from orka.scheduler.indexed import IndexedStage
from orka.scheduler.pipeline import Decision, Pipeline, PipelineConfig, filter_nodes
from orka.scheduler.registry import Hold, Registry
from orka.scheduler.snapshot import Snapshot
from tests.unit.scheduler.builders import GIB, node, request

TCP, UDP = PortProtocol.TCP, PortProtocol.UDP

# ---- the rule, one reason at a time ----

RULE: list[tuple[str, dict[str, Any], dict[str, Any], fit.Reason | None, bool | None]] = [
    # id, node overrides, request overrides, reason, resolvable
    ("fits", {}, {}, None, None),
    ("not-ready", {"state": NodeState.NOT_READY}, {}, fit.NOT_READY, True),
    ("lost", {"state": NodeState.LOST}, {}, fit.LOST, True),
    ("left", {"state": NodeState.LEFT}, {}, fit.LEFT, True),
    ("cordoned", {"schedulable": False}, {}, fit.CORDONED, True),
    ("no-driver", {"drivers": frozenset({"containerd"})}, {}, fit.no_driver("process"), False),
    ("fake-serves-any", {"drivers": frozenset({"fake"})}, {"kind": WorkloadKind.VM}, None, None),
    ("cpu-above-capacity", {}, {"cpu_millis": 4001}, fit.CPU_ABOVE_CAPACITY, False),
    ("mem-above-capacity", {}, {"memory_bytes": 8 * GIB + 1}, fit.MEMORY_ABOVE_CAPACITY, False),
    ("insufficient-cpu", {"cpu_used": 3501}, {}, fit.INSUFFICIENT_CPU, True),
    ("insufficient-memory", {"mem_used": 7 * GIB + 1}, {}, fit.INSUFFICIENT_MEMORY, True),
    ("exactly-full", {"cpu_used": 3500, "mem_used": 7 * GIB}, {}, None, None),
    # Over capacity in memory outranks short of free cpu: no amount of waiting helps.
    (
        "capacity-before-room",
        {"cpu_used": 4000},
        {"memory_bytes": 9 * GIB},
        fit.MEMORY_ABOVE_CAPACITY,
        False,
    ),
    (
        "selector",
        {"labels": {"zone": "us"}},
        {"node_selector": {"zone": "eu"}},
        fit.selector_mismatch("zone", "eu"),
        False,
    ),
    (
        "spread",
        {"workload_counts": {"web": 2}},
        {"max_per_node": 2},
        fit.spread_limit(2),
        True,
    ),
    ("pool-mismatch", {"pool": "gpu"}, {"pool": "default"}, fit.pool_mismatch("gpu"), False),
    ("pool-matches", {"pool": "gpu"}, {"pool": "gpu"}, None, None),
    ("no-pool-asked", {"pool": "gpu"}, {}, None, None),
    # A pool that differs outranks a missing driver: the pool is what the user asked for.
    (
        "pool-before-driver",
        {"pool": "gpu", "drivers": frozenset({"containerd"})},
        {"pool": "default"},
        fit.pool_mismatch("gpu"),
        False,
    ),
    # A class too big for the node even empty names the class, not the capacity.
    (
        "class-too-big",
        {},
        {"cpu_millis": 4001, "class_name": "large"},
        fit.class_unsupported("large"),
        False,
    ),
    (
        "class-mem-too-big",
        {},
        {"memory_bytes": 8 * GIB + 1, "class_name": "large"},
        fit.class_unsupported("large"),
        False,
    ),
    # ... while a full node stays a resolvable shortage.
    ("class-node-full", {"cpu_used": 3501}, {"class_name": "small"}, fit.INSUFFICIENT_CPU, True),
    # Precedence: a lost node says lost, not full.
    ("lost-and-full", {"state": NodeState.LOST, "cpu_used": 4000}, {}, fit.LOST, True),
    (
        "host-port-in-use",
        {"host_ports": {(8080, TCP)}},
        {"host_ports": {(8080, TCP)}},
        fit.host_port_in_use(8080, TCP),
        True,
    ),
    (
        "host-port-other-protocol",
        {"host_ports": {(8080, UDP)}},
        {"host_ports": {(8080, TCP)}},
        None,
        None,
    ),
    ("host-port-none-asked", {"host_ports": {(8080, TCP)}}, {}, None, None),
    # Precedence: the node's resources, then its labels (no waiting helps), then its ports,
    # then the spread limit.
    (
        "full-before-port",
        {"cpu_used": 4000, "host_ports": {(8080, TCP)}},
        {"host_ports": {(8080, TCP)}},
        fit.INSUFFICIENT_CPU,
        True,
    ),
    (
        "selector-before-port",
        {"labels": {"zone": "us"}, "host_ports": {(8080, TCP)}},
        {"node_selector": {"zone": "eu"}, "host_ports": {(8080, TCP)}},
        fit.selector_mismatch("zone", "eu"),
        False,
    ),
    (
        "port-before-spread",
        {"workload_counts": {"web": 1}, "host_ports": {(8080, TCP)}},
        {"max_per_node": 1, "host_ports": {(8080, TCP)}},
        fit.host_port_in_use(8080, TCP),
        True,
    ),
]


@pytest.mark.parametrize(
    ("node_overrides", "req_overrides", "reason", "resolvable"),
    [case[1:] for case in RULE],
    ids=[case[0] for case in RULE],
)
def test_rule(
    node_overrides: dict[str, Any],
    req_overrides: dict[str, Any],
    reason: fit.Reason | None,
    resolvable: bool | None,
) -> None:
    got = fit.fit(request(**req_overrides), node(**node_overrides))
    assert got == reason
    if got is not None:
        assert got.resolvable is resolvable
        assert got.resolvable is fit.RESOLVABLE[got.code]


@pytest.mark.parametrize(
    ("reason", "code", "message"),
    [
        (fit.no_driver("libvirt"), "NO_DRIVER", "no libvirt driver"),
        (fit.selector_mismatch("disk", "ssd"), "NODE_SELECTOR_MISMATCH", "label disk != ssd"),
        (fit.spread_limit(1), "SPREAD_LIMIT", "spread: 1 replica already on node"),
        (fit.spread_limit(3), "SPREAD_LIMIT", "spread: 3 replicas already on node"),
        (fit.refused("disk full"), "OFFER_REFUSED", "refused: disk full"),
        (fit.OFFER_TIMED_OUT, "OFFER_TIMED_OUT", "offer timed out"),
        (fit.GONE, "NODE_GONE", "gone"),
        (fit.host_port_in_use(8080, TCP), "HOST_PORT_IN_USE", "host port 8080 in use"),
        (fit.host_port_in_use(53, UDP), "HOST_PORT_IN_USE", "host port 53/udp in use"),
        (fit.host_port_in_use(65535, UDP), "HOST_PORT_IN_USE", "host port 65535/udp in use"),
        (fit.SHUTTING_DOWN, "NODE_SHUTTING_DOWN", "node is shutting down"),
        (
            fit.volume_elsewhere("data-1", "node-2"),
            "VOLUME_ELSEWHERE",
            "volume data-1 lives on node-2",
        ),
        (fit.volume_pool("data-1", "gpu"), "VOLUME_POOL", "volume data-1 needs pool gpu"),
        (fit.volume_backend("qcow2"), "VOLUME_BACKEND", "no qcow2 volumes on this node"),
    ],
)
def test_parametrised_reasons(reason: fit.Reason, code: str, message: str) -> None:
    assert (reason.code.value, reason.message, str(reason)) == (code, message, message)


def test_every_code_says_whether_waiting_helps() -> None:
    assert set(fit.RESOLVABLE) == set(fit.Code)
    unresolvable = {c for c, r in fit.RESOLVABLE.items() if not r}
    assert unresolvable == {
        fit.Code.NO_DRIVER,
        fit.Code.NODE_SELECTOR_MISMATCH,
        fit.Code.CPU_ABOVE_CAPACITY,
        fit.Code.MEMORY_ABOVE_CAPACITY,
        fit.Code.POOL_MISMATCH,
        fit.Code.CLASS_UNSUPPORTED,
        fit.Code.VOLUME_POOL,
        fit.Code.VOLUME_BACKEND,
        fit.Code.VOLUME_TOO_BIG,
    }


def test_reasons_are_interned_and_counted_by_content() -> None:
    a = fit.reason(fit.Code.NO_DRIVER, "no vm driver")
    assert a is fit.reason(fit.Code.NO_DRIVER, "no vm driver")
    assert fit.no_driver("libvirt") is fit.reason(fit.Code.NO_DRIVER, "no libvirt driver")
    assert a != fit.reason(fit.Code.NO_DRIVER, "no process driver")
    # Two objects with one content (made apart from the intern table) still make one line.
    twin = fit.Reason(fit.Code.NO_DRIVER, "no vm driver")
    assert twin is not a
    assert fit.count_reasons({a: 2, twin: 1}) == [
        fit.ReasonCount("NO_DRIVER", "no vm driver", 3, False)
    ]


@pytest.mark.parametrize(
    ("used", "req", "text"),
    [
        ((3900, 0), (200, GIB), "insufficient cpu: 200m requested, 100m free"),
        ((0, 7 * GIB + GIB // 2), (200, GIB), "insufficient memory: 1024Mi requested, 512Mi free"),
        ((0, 0), (5000, 0), "cpu request exceeds node capacity: 5000m requested, 4000m capacity"),
        (
            (0, 0),
            (0, 9 * GIB),
            "memory request exceeds node capacity: 9216Mi requested, 8192Mi capacity",
        ),
    ],
)
def test_explain_resources(used: tuple[int, int], req: tuple[int, int], text: str) -> None:
    need = Resources(cpu_millis=req[0], memory_bytes=req[1])
    room = fit.Room(4000, 8 * GIB, used[0], used[1])
    reason = fit.resources(need, room)
    assert reason is not None
    assert fit.explain_resources(reason, need, room) == text


# ---- the reasons made while a test runs (the constants above are made at import) ----


class _LaterState(StrEnum):
    """A node state added after fit.py was written."""

    DRAINING = "DRAINING"


@pytest.mark.parametrize(
    ("state", "schedulable", "code", "message"),
    [
        (NodeState.READY, True, None, None),
        (NodeState.READY, False, "NODE_CORDONED", "cordoned"),
        (NodeState.NOT_READY, True, "NODE_NOT_READY", "not ready"),
        (NodeState.LOST, True, "NODE_LOST", "lost"),
        (NodeState.LEFT, False, "NODE_LEFT", "left"),
        # A state the table does not know still rejects, and the message names it.
        (_LaterState.DRAINING, True, "NODE_NOT_READY", "draining"),
    ],
)
def test_availability_and_ready_name_the_state(
    state: Any, schedulable: bool, code: str | None, message: str | None
) -> None:
    view = node(state=state, schedulable=schedulable)
    got = fit.availability(view)
    assert (got and (got.code.value, got.message, got.resolvable)) == (
        (code, message, True) if code else None
    )
    # ready() is the state half of availability(): the same reason, the same object.
    ready = fit.ready(request(), view)
    if state is NodeState.READY:
        assert ready is None
    else:
        assert ready is got
        assert ready is fit.availability(view)


def test_refused_quotes_the_agent() -> None:
    got = fit.refused("image missing on this agent")
    assert (got.code, got.message, got.resolvable) == (
        fit.Code.OFFER_REFUSED,
        "refused: image missing on this agent",
        True,
    )


@pytest.mark.parametrize("code", list(fit.Code))
def test_a_reason_made_now_says_whether_waiting_helps(code: fit.Code) -> None:
    assert fit.Reason(code, "made now").resolvable is fit.RESOLVABLE[code]


def test_intern_table_starts_over_once_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit, "_INTERNED", {})
    monkeypatch.setattr(fit, "_MAX_INTERNED", 2)
    first = fit.reason(fit.Code.OFFER_REFUSED, "a")
    fit.reason(fit.Code.OFFER_REFUSED, "b")
    assert len(fit._INTERNED) == 2  # full, not yet past the limit
    fit.reason(fit.Code.OFFER_REFUSED, "c")
    assert list(fit._INTERNED) == [(fit.Code.OFFER_REFUSED, "c")]
    assert fit.reason(fit.Code.OFFER_REFUSED, "a") is not first


@pytest.mark.parametrize(
    ("req", "used", "bound", "fits"),
    [
        # share = 2000/4000 + 4/8 = 1.0, so the most used that fits is 1.0: exactly full fits.
        ((2000, 4 * GIB), (2000, 4 * GIB), 1.0, True),
        ((2000, 4 * GIB), (2001, 4 * GIB), 1.0, False),
        ((0, 0), (4000, 8 * GIB), 2.0, True),
        ((1000, 2 * GIB), (3000, 0), 1.5, True),
        ((4000, 8 * GIB), (0, 0), 0.0, True),
    ],
)
def test_most_used_that_fits_bounds_what_resources_accepts(
    req: tuple[int, int], used: tuple[int, int], bound: float, fits: bool
) -> None:
    share = req[0] / 4000 + req[1] / (8 * GIB)
    assert fit.most_used_that_fits(share) == bound
    room = fit.Room(4000, 8 * GIB, used[0], used[1])
    need = Resources(cpu_millis=req[0], memory_bytes=req[1])
    assert (fit.resources(need, room) is None) is fits
    if fits:
        assert used[0] / 4000 + used[1] / (8 * GIB) <= bound


def test_reasons_count_and_format_most_common_first() -> None:
    counts = fit.count_reasons(
        {fit.CORDONED: 1, fit.INSUFFICIENT_MEMORY: 3, fit.no_driver("containerd"): 1}
    )
    assert [(c.code, c.node_count, c.resolvable) for c in counts] == [
        ("INSUFFICIENT_MEMORY", 3, True),
        ("NODE_CORDONED", 1, True),
        ("NO_DRIVER", 1, False),
    ]
    assert fit.format_reasons(counts) == (
        "3 nodes: insufficient memory; 1 node: cordoned; 1 node: no containerd driver"
    )
    assert fit.format_reasons([]) == "no nodes"


@pytest.mark.parametrize(
    ("rejections", "unresolvable"),
    [
        ({}, False),  # no nodes at all: a node joining is what it waits for, retried as before
        ({fit.no_driver("libvirt"): 3}, True),
        ({fit.no_driver("libvirt"): 2, fit.selector_mismatch("zone", "eu"): 1}, True),
        ({fit.no_driver("libvirt"): 2, fit.INSUFFICIENT_CPU: 1}, False),
        ({fit.CPU_ABOVE_CAPACITY: 2, fit.OFFER_TIMED_OUT: 1}, False),
    ],
)
def test_unresolvable_only_when_every_reason_is(
    rejections: dict[fit.Reason, int], unresolvable: bool
) -> None:
    assert fit.unresolvable(fit.count_reasons(rejections)) is unresolvable


def test_place_result_round_trips_structured_reasons() -> None:
    rejections = {fit.INSUFFICIENT_MEMORY: 3, fit.no_driver("libvirt"): 2}
    msg = place_result_to_pb("web-0", refusals={"n9": fit.OFFER_TIMED_OUT}, rejections=rejections)
    assert msg.node == "" and dict(msg.refusals) == {"n9": "offer timed out"}
    assert [(r.code, r.message, r.node_count, r.resolvable) for r in msg.reasons] == [
        ("INSUFFICIENT_MEMORY", "insufficient memory", 3, True),
        ("NO_DRIVER", "no libvirt driver", 2, False),
    ]
    back = reasons_from_pb(type(msg).FromString(msg.SerializeToString()))
    assert back == fit.count_reasons(rejections)
    assert fit.format_reasons(back) == "3 nodes: insufficient memory; 2 nodes: no libvirt driver"


# ---- the four places that ask it agree ----


class _Admits:
    """A driver with nothing of its own to refuse (the agent asks a driver only this)."""

    def admit(self, spec: WorkloadSpec) -> str | None:
        return None


# Host ports drawn from a few neighbours: the same port on the other protocol and the ports
# one below and above are where a wrong comparison would show.
_PORTS = [(8080, TCP), (8080, UDP), (8079, TCP), (8081, TCP), (53, UDP)]

_DRIVER_SETS = [
    frozenset({"process"}),
    frozenset({"containerd"}),
    frozenset({"process", "containerd"}),
    frozenset({"fake"}),
    frozenset(),
]


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Any, Any]:
    cpu_alloc = draw(st.sampled_from([0, 1, 500, 1000, 4000]))
    mem_alloc = draw(st.sampled_from([0, 1, 256, 1024, 4096]))
    view = node(
        name="n1",
        # Mostly nodes that take instances, so the resource checks get asked.
        state=draw(st.one_of(st.just(NodeState.READY), st.sampled_from(list(NodeState)))),
        schedulable=draw(st.one_of(st.just(True), st.booleans())),
        drivers=draw(st.just(frozenset({"process", "containerd"})) | st.sampled_from(_DRIVER_SETS)),
        labels=draw(st.sampled_from([{}, {"zone": "eu"}, {"zone": "us"}])),
        cpu_allocatable=cpu_alloc,
        mem_allocatable=mem_alloc,
        cpu_used=draw(st.integers(0, cpu_alloc) | st.integers(0, cpu_alloc + 10)),
        mem_used=draw(st.integers(0, mem_alloc) | st.integers(0, mem_alloc + 10)),
        host_ports=draw(st.frozensets(st.sampled_from(_PORTS), max_size=3)),
    )
    # Boundaries are where wordings of the rule used to differ: exactly the free amount, one
    # more, exactly the capacity, one more; plus anything.
    free_cpu = max(0, cpu_alloc - view.cpu_used)
    free_mem = max(0, mem_alloc - view.mem_used)
    cpu_edges = [0, free_cpu, free_cpu + 1, cpu_alloc, cpu_alloc + 1]
    mem_edges = [0, free_mem, free_mem + 1, mem_alloc, mem_alloc + 1]
    req = request(
        kind=draw(st.sampled_from([WorkloadKind.PROCESS, WorkloadKind.CONTAINER])),
        cpu_millis=draw(
            st.sampled_from(cpu_edges) | st.integers(0, free_cpu) | st.integers(0, 4100)
        ),
        memory_bytes=draw(
            st.sampled_from(mem_edges) | st.integers(0, free_mem) | st.integers(0, 4200)
        ),
        node_selector=draw(st.sampled_from([{}, {}, {"zone": "eu"}])),
        # Mostly none, as most workloads fix no host port.
        host_ports=draw(
            st.just(frozenset()) | st.frozensets(st.sampled_from(_PORTS), min_size=1, max_size=3)
        ),
    )
    return view, req


def _by_filters(req: Any, view: Any) -> fit.Reason | None:
    checks = [f.check for f in FILTERS if f.applies(req)]
    _, rejections = filter_nodes(req, (view,), checks)
    return next(iter(rejections), None)


def _by_registry(req: Any, view: Any) -> fit.Reason | None:
    reg = Registry()
    rec = reg.upsert(view.name)
    rec.state = view.state
    rec.schedulable = view.schedulable
    rec.drivers = view.drivers
    rec.labels = dict(view.labels)
    rec.allocatable = Resources(cpu_millis=view.cpu_allocatable, memory_bytes=view.mem_allocatable)
    rec.session = object()  # type: ignore[assignment]
    rec.add_hold("other", Hold("db", view.cpu_used, view.mem_used, host_ports=view.host_ports))
    return reg.try_reserve(rec, req, 30.0)


def _by_index(req: Any, view: Any) -> bool | None:
    """Whether the indexed stage finds the node, with a limit of 1 on a one-node snapshot, for
    either scorer's walk; None when it leaves the decision to the exhaustive stage."""
    verdicts = set()
    for policy in ("spread", "binpack"):
        pipeline = Pipeline(PipelineConfig(policy=policy))
        assert isinstance(pipeline.indexed, IndexedStage)
        snap = Snapshot.of([view])
        checks = [f.check for f in FILTERS if f.applies(req)]
        d = Decision(req, snap, 1, checks, SnapshotIndex.build(snap.nodes))
        ranking = pipeline.indexed.rank(d)
        verdicts.add(None if ranking is None else ranking.candidates == (view.name,))
    assert len(verdicts) == 1, "the two walks disagree"
    return verdicts.pop()


def _by_agent(req: Any, view: Any, tmp: Path) -> str | None:
    """The agent's own admission on a node like `view` (it knows no cordon, labels or state)."""
    admission = Admission(
        capacity=Resources(cpu_millis=view.cpu_allocatable, memory_bytes=view.mem_allocatable),
        allowed_paths=[tmp],
        healthy={name: _Admits() for name in view.drivers},  # type: ignore[misc]
        instances={},
        shutting_down=lambda: False,
        send=lambda msg: None,
    )
    used = Resources(cpu_millis=view.cpu_used, memory_bytes=view.mem_used)
    admission.reservations["other"] = Reservation(
        used, time.monotonic() + 60, frozenset(view.host_ports)
    )
    kind = req.kind
    container = kind is WorkloadKind.CONTAINER
    spec = WorkloadSpec(
        name="web",
        kind=kind,
        command=["sleep", "1"],
        image="busybox" if container else "",
        resources=Resources(cpu_millis=req.cpu_millis, memory_bytes=req.memory_bytes),
        ports=[
            PortSpec(name=f"p{i}", port=80 if container else None, host_port=hp, protocol=proto)
            for i, (hp, proto) in enumerate(sorted(req.host_ports))
        ],
    )
    assert spec.fixed_host_ports == req.host_ports
    return admission.admit("web-0", spec)


@settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=_cases())
# The boundaries, always: an exact fit of a half-used node, one millicore more, a request of
# the whole capacity of an empty node, and of one byte more.
@example(
    case=(node(cpu_used=2000, mem_used=4 * GIB), request(cpu_millis=2000, memory_bytes=4 * GIB))
)
@example(case=(node(cpu_used=2000, mem_used=4 * GIB), request(cpu_millis=2001, memory_bytes=GIB)))
@example(case=(node(), request(cpu_millis=4000, memory_bytes=8 * GIB)))
@example(case=(node(), request(cpu_millis=1, memory_bytes=8 * GIB + 1)))
# Host ports: the very port taken, the same number on the other protocol, the neighbours, and
# a taken port on a node the selector rules out (the label is named, as no waiting helps).
@example(case=(node(host_ports={(8080, TCP)}), request(host_ports={(8080, TCP)})))
@example(case=(node(host_ports={(8080, UDP)}), request(host_ports={(8080, TCP)})))
@example(case=(node(host_ports={(8079, TCP), (8081, TCP)}), request(host_ports={(8080, TCP)})))
@example(
    case=(
        node(host_ports={(8080, TCP), (53, UDP)}),
        request(host_ports={(8081, TCP), (53, UDP), (8080, TCP)}),
    )
)
@example(
    case=(
        node(labels={"zone": "us"}, host_ports={(8080, TCP)}),
        request(node_selector={"zone": "eu"}, host_ports={(8080, TCP)}),
    )
)
def test_filters_index_registry_and_agent_agree(case: tuple[Any, Any], tmp_path: Path) -> None:
    view, req = case
    rule = fit.fit(req, view)
    # The filters, in their order, and the registry's reservation name the same reason.
    assert _by_filters(req, view) == rule
    assert _by_registry(req, view) == rule
    # The index finds every node that fits and no other; a node it cannot order (it offers
    # no cpu or no memory at all) it may leave to the exhaustive stage.
    found = _by_index(req, view)
    if rule is not None:
        assert found is not True
    elif view.cpu_allocatable > 0 and view.mem_allocatable > 0:
        assert found is True
    else:
        assert found is not False
    # The agent asks the same rule of what it knows: drivers, resources and host ports.
    agent_rule = fit.driver(req, view) or fit.resources(req, view) or fit.host_ports(req, view)
    said = _by_agent(req, view, tmp_path)
    if agent_rule is None:
        assert said is None
    else:
        assert said is not None and said.startswith(agent_rule.message)
    if rule is not None and rule.code in _AGENT_KNOWS:
        assert said is not None and said.startswith(rule.message)


_AGENT_KNOWS = {
    fit.Code.NO_DRIVER,
    fit.Code.CPU_ABOVE_CAPACITY,
    fit.Code.MEMORY_ABOVE_CAPACITY,
    fit.Code.INSUFFICIENT_CPU,
    fit.Code.INSUFFICIENT_MEMORY,
    fit.Code.HOST_PORT_IN_USE,
}
