"""The scheduler's live picture of the cluster: nodes, what they hold, and reservations.

Soft state only. It is rebuilt from agents re-registering after a restart, so nothing here is
ever written to disk.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orka import fit
from orka.models import (
    DEFAULT_POOL,
    TERMINAL_PHASES,
    InstanceReport,
    Node,
    NodeState,
    Resources,
)
from orka.scheduler.index import SnapshotIndex, updated
from orka.scheduler.snapshot import Layered, NodeView, PlacementRequest, Snapshot

if TYPE_CHECKING:
    from orka.api import agent_pb2 as apb
    from orka.scheduler.session import AgentSession


@dataclass(slots=True)
class Hold:
    """Resources an instance takes on a node: reserved by an offer, or bound and running."""

    workload: str
    cpu_millis: int
    memory_bytes: int
    # Reservations expire if the controller never commits them (it crashed, the agent left).
    expires_at: float | None = None
    # The host ports it binds: the fixed ones it asked for, and those its agent reports bound.
    host_ports: frozenset[fit.HostPort] = fit.NO_HOST_PORTS


@dataclass(slots=True)
class NodeRecord:
    name: str
    capacity: Resources = field(default_factory=Resources)
    allocatable: Resources = field(default_factory=Resources)
    usage: Resources = field(default_factory=Resources)
    labels: dict[str, str] = field(default_factory=dict)
    drivers: frozenset[str] = frozenset()
    state: NodeState = NodeState.READY
    schedulable: bool = True
    draining: bool = False
    # Its agent announced a leave on its current stream: soft state, ended by registering
    # again. Apart from `draining`, which only an operator sets and the controller keeps.
    leaving: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    last_heartbeat_wall: float = field(default_factory=time.time)
    # The least a heartbeat of this node took from its `sent_at` to being read (drifting up
    # slowly): its clock's offset from ours plus the network, what a late read is measured
    # from (orka/scheduler/liveness.py: heard).
    lag_floor: float = float("inf")
    # The heartbeat interval this node was told (0: the configured one), and a shorter one
    # told since, which counts from its next heartbeat (orka/scheduler/pace.py).
    interval: float = 0.0
    next_interval: float = 0.0
    # The interval it said it heartbeat at when it registered (0: not said), a hint to the
    # pace of a term that has just begun (orka/scheduler/pace.py).
    hinted: float = 0.0
    session: AgentSession | None = None
    holds: dict[str, Hold] = field(default_factory=dict)
    reports: dict[str, InstanceReport] = field(default_factory=dict)
    cpu_used: int = 0
    mem_used: int = 0
    # Host port -> how many holds bind it (more than one only when agents say so: a
    # reservation never takes a port in use). Empty on nodes whose instances fix none.
    port_users: dict[fit.HostPort, int] = field(default_factory=dict)
    message: str = ""
    pool: str = DEFAULT_POOL
    volume_backends: frozenset[str] = frozenset()
    volume_capacity_bytes: int = 0
    # Its agent's last report of each volume it holds (orka/scheduler/volumes.py).
    volumes: dict[str, apb.VolumeStatus] = field(default_factory=dict)

    def free(self) -> tuple[int, int]:
        return (
            self.allocatable.cpu_millis - self.cpu_used,
            self.allocatable.memory_bytes - self.mem_used,
        )

    def add_hold(self, instance: str, hold: Hold) -> None:
        old = self.holds.pop(instance, None)
        if old is not None:
            self.cpu_used -= old.cpu_millis
            self.mem_used -= old.memory_bytes
            if old.host_ports:
                self._unbind(old.host_ports)
        self.holds[instance] = hold
        self.cpu_used += hold.cpu_millis
        self.mem_used += hold.memory_bytes
        if hold.host_ports:
            users = self.port_users
            for port in hold.host_ports:
                users[port] = users.get(port, 0) + 1

    def drop_hold(self, instance: str) -> bool:
        old = self.holds.pop(instance, None)
        if old is None:
            return False
        self.cpu_used -= old.cpu_millis
        self.mem_used -= old.memory_bytes
        if old.host_ports:
            self._unbind(old.host_ports)
        return True

    def _unbind(self, ports: frozenset[fit.HostPort]) -> None:
        users = self.port_users
        for port in ports:
            left = users.get(port, 0) - 1
            if left > 0:
                users[port] = left
            else:
                users.pop(port, None)

    @property
    def host_ports(self) -> frozenset[fit.HostPort]:
        """The host ports bound on the node by the instances it holds."""
        return frozenset(self.port_users) if self.port_users else fit.NO_HOST_PORTS

    def view(self) -> NodeView:
        counts: dict[str, int] = {}
        for h in self.holds.values():
            counts[h.workload] = counts.get(h.workload, 0) + 1
        return NodeView(
            name=self.name,
            state=self.state,
            schedulable=self.takes_new,
            drivers=self.drivers,
            labels=self.labels,
            cpu_allocatable=self.allocatable.cpu_millis,
            mem_allocatable=self.allocatable.memory_bytes,
            cpu_used=self.cpu_used,
            mem_used=self.mem_used,
            workload_counts=counts,
            total_instances=len(self.holds),
            host_ports=frozenset(self.port_users) if self.port_users else fit.NO_HOST_PORTS,
            pool=self.pool,
            volume_backends=self.volume_backends,
            volume_capacity_bytes=self.volume_capacity_bytes,
        )

    @property
    def takes_new(self) -> bool:
        """New instances may be placed here: not cordoned, draining or leaving."""
        return self.schedulable and not self.draining and not self.leaving

    def to_model(self) -> Node:
        return Node(
            name=self.name,
            state=self.state,
            schedulable=self.schedulable,
            draining=self.draining,
            leaving=self.leaving,
            capacity=self.capacity,
            allocatable=self.allocatable,
            allocated=Resources(cpu_millis=self.cpu_used, memory_bytes=self.mem_used),
            usage=self.usage,
            labels=dict(self.labels),
            drivers=sorted(self.drivers),
            instance_count=len(self.holds),
            last_heartbeat=self.last_heartbeat_wall,
            message=self.message,
            pool=self.pool,
            volume_backends=sorted(self.volume_backends),
            volume_capacity_bytes=self.volume_capacity_bytes,
        )


class _Live:
    """A node record as the fit rule reads it, straight from the live fields: what its view
    would say, without building one for every reservation."""

    __slots__ = ("_rec",)

    def __init__(self, rec: NodeRecord) -> None:
        self._rec = rec

    @property
    def state(self) -> NodeState:
        return self._rec.state

    @property
    def schedulable(self) -> bool:
        return self._rec.takes_new

    @property
    def drivers(self) -> frozenset[str]:
        return self._rec.drivers

    @property
    def labels(self) -> dict[str, str]:
        return self._rec.labels

    @property
    def cpu_allocatable(self) -> int:
        return self._rec.allocatable.cpu_millis

    @property
    def mem_allocatable(self) -> int:
        return self._rec.allocatable.memory_bytes

    @property
    def cpu_used(self) -> int:
        return self._rec.cpu_used

    @property
    def mem_used(self) -> int:
        return self._rec.mem_used

    @property
    def host_ports(self) -> dict[fit.HostPort, int]:
        # Read only when the request fixes a host port; the rule asks only `port in` it.
        return self._rec.port_users

    @property
    def name(self) -> str:
        return self._rec.name

    @property
    def pool(self) -> str:
        return self._rec.pool

    @property
    def volume_backends(self) -> frozenset[str]:
        return self._rec.volume_backends

    @property
    def volume_capacity_bytes(self) -> int:
        return self._rec.volume_capacity_bytes

    @property
    def workload_counts(self) -> dict[str, int]:
        # Read only when the request has a spread limit.
        counts: dict[str, int] = {}
        for h in self._rec.holds.values():
            counts[h.workload] = counts.get(h.workload, 0) + 1
        return counts


class Registry:
    """Nodes by name, with a cached snapshot rebuilt only after something changed."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}
        self._snapshot: Snapshot | None = None
        # Snapshots share `_base`, the views as of some earlier snapshot in registration order,
        # and each copies `_since`, the views rebuilt after it (see Layered); a reservation
        # rebuilds one view, not all. `_base` is replaced, never changed, once `_since` grows
        # past _rebase_at: each snapshot then copies about the square root of the node count.
        self._base: dict[str, NodeView] = {}
        self._since: dict[str, NodeView] = {}
        # Nodes changed since the last snapshot; None when everything must be rebuilt.
        self._dirty: set[str] | None = set()
        self._last: Snapshot | None = None

    def __iter__(self) -> Iterator[NodeRecord]:
        return iter(self.nodes.values())

    def get(self, name: str) -> NodeRecord | None:
        return self.nodes.get(name)

    def changed(self, node: NodeRecord | None = None) -> None:
        """Something changed: one node's record when `node` is given, else anything."""
        self._snapshot = None
        if node is None or self._dirty is None:
            self._dirty = None
        else:
            self._dirty.add(node.name)

    def snapshot(self) -> Snapshot:
        if self._snapshot is not None:
            return self._snapshot
        previous = self._last
        dirty = self._dirty
        if dirty is None:
            self._base = {name: n.view() for name, n in self.nodes.items()}
            self._since = {}
        else:
            since, base = self._since, self._base
            rebase = False
            for name in dirty:
                rec = self.nodes.get(name)
                if rec is None or name not in base:
                    rebase = True  # a node came or went: the names change
                    if rec is not None:
                        since[name] = rec.view()
                else:
                    since[name] = rec.view()
            if rebase:
                # Registration order, whatever order the dirty set had.
                self._base = {name: since.get(name) or base[name] for name in self.nodes}
                self._since = {}
            elif len(since) > _rebase_at(len(base)):
                # The same names: a copy keeps their order (and is a fraction of the above).
                self._base = base = dict(base)
                base.update(since)
                self._since = {}
        views = Layered(self._base, dict(self._since))
        # Carry the index over when only a few nodes changed (copy-on-write), else index anew:
        # from the second snapshot on, so a registry built for one decision never pays for it.
        index: SnapshotIndex | None = None
        if previous is not None and previous.index is not None and dirty is not None:
            before = previous.by_name
            old = [before[n] for n in dirty if n in before]
            new = [views[n] for n in dirty if n in views]
            index = updated(previous.index, old, new)
        elif previous is not None:
            index = SnapshotIndex.build(views.values())
        snap = Snapshot.layered(views, index)
        self._dirty = set()
        self._snapshot = self._last = snap
        return snap

    def upsert(self, name: str) -> NodeRecord:
        rec = self.nodes.get(name)
        if rec is None:
            rec = NodeRecord(name=name)
            self.nodes[name] = rec
        self.changed(rec)
        return rec

    def try_reserve(
        self, node: NodeRecord, req: PlacementRequest, hold_seconds: float
    ) -> fit.Reason | None:
        """Check the live record (not the snapshot) and reserve; returns a reason on failure.

        The snapshot a ranking used may be stale by now; this check is the one that prevents
        overbooking, and it runs without an await, so no other placement can interleave. It is
        the same rule the filters ranked by, asked of a view of the record as it is now.
        """
        if node.session is None:
            return fit.NOT_READY  # no stream to offer it on
        reason = fit.fit(req, _Live(node))
        if reason is not None:
            return reason
        node.add_hold(
            req.instance,
            Hold(
                workload=req.workload,
                cpu_millis=req.cpu_millis,
                memory_bytes=req.memory_bytes,
                expires_at=time.monotonic() + hold_seconds,
                host_ports=req.host_ports,
            ),
        )
        self.changed(node)
        return None

    def release(self, node: NodeRecord, instance: str) -> None:
        if node.drop_hold(instance):
            self.changed(node)

    def apply_report(self, node: NodeRecord, report: InstanceReport, resources: Resources) -> bool:
        """Record what an agent said; returns True when it differs from what it said before."""
        old = node.reports.get(report.name)
        node.reports[report.name] = report
        if report.phase in TERMINAL_PHASES:
            self.release(node, report.name)
        else:
            hold = node.holds.get(report.name)
            # Host ports the agent says it bound beyond those the hold has (ports it picked
            # itself, or fixed ones of an instance this scheduler did not place): usually none.
            more = _bound_ports(report, hold)
            if (
                hold is not None
                and hold.expires_at is not None
                and not more
                and hold.workload == report.workload
                and hold.cpu_millis == resources.cpu_millis
                and hold.memory_bytes == resources.memory_bytes
            ):
                # The reservation becomes the bound hold as it is: no view of the node changes,
                # so the snapshot (and its index) stays valid.
                hold.expires_at = None
            elif hold is None or hold.expires_at is not None or more:
                # A bound hold keeps its resources; a reservation's fixed ports stay with it.
                cpu, mem = (
                    (resources.cpu_millis, resources.memory_bytes)
                    if hold is None or hold.expires_at is not None
                    else (hold.cpu_millis, hold.memory_bytes)
                )
                ports = more if hold is None else hold.host_ports | more
                node.add_hold(report.name, Hold(report.workload, cpu, mem, host_ports=ports))
                self.changed(node)
        if old is None:
            return True
        return (
            old.phase != report.phase
            or old.restarts != report.restarts
            or old.exit_code != report.exit_code
            or old.reason != report.reason
            or old.message != report.message
            or old.health != report.health
            or old.health_message != report.health_message
        )

    def forget(self, node: NodeRecord, instance: str) -> None:
        node.reports.pop(instance, None)
        self.release(node, instance)

    def expire_reservations(self, now: float) -> list[tuple[str, str]]:
        expired = []
        for node in self.nodes.values():
            holds = node.holds
            if not holds:
                continue  # runs every liveness tick over every node: no copy for empty ones
            due = [
                name
                for name, hold in holds.items()
                if hold.expires_at is not None and hold.expires_at < now
            ]
            for name in due:
                node.drop_hold(name)
                expired.append((node.name, name))
        if expired:
            self.changed()
        return expired


def _bound_ports(report: InstanceReport, hold: Hold | None) -> frozenset[fit.HostPort]:
    """The host ports `report` says its instance bound that `hold` does not count yet."""
    if not report.ports:
        return fit.NO_HOST_PORTS
    bound = frozenset((b.host_port, b.protocol) for b in report.ports if b.host_port)
    return bound - hold.host_ports if hold is not None else bound


def _rebase_at(nodes: int) -> int:
    """How many changed views a snapshot copies before the next one takes a new base."""
    return max(16, math.isqrt(nodes))
