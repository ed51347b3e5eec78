"""Does this instance fit this node: the one rule, and the reasons it gives when it does not.

Every place that decides whether a node can take an instance asks this module: the scheduler's
filters (ranking), its index (which nodes are worth checking at all), the registry's reservation
(the check that prevents overbooking) and the agent's own admission. It lives outside
`orka.scheduler` so the agent can use it without importing the scheduler.

Each reason is a named constant with a stable `code` for programs and a `message` for people, and
says whether waiting can help (Kubernetes' Unschedulable vs UnschedulableAndUnresolvable): a full
node may free room and a cordoned one may be uncordoned, but a node without the driver never grows
one by itself, and a request bigger than a node's whole capacity never fits it. An instance every
node refused for unresolvable reasons waits for the cluster's shape (or its spec) to change
instead of being offered again on every heartbeat.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from orka.models import FAKE_DRIVER, KIND_DRIVER, NodeState, PortProtocol, WorkloadKind


class Code(StrEnum):
    """Stable reason names; the wire and the CLI carry these, so they are never renamed."""

    NODE_NOT_READY = "NODE_NOT_READY"
    NODE_LOST = "NODE_LOST"
    NODE_LEFT = "NODE_LEFT"
    NODE_GONE = "NODE_GONE"
    NODE_CORDONED = "NODE_CORDONED"
    NODE_SHUTTING_DOWN = "NODE_SHUTTING_DOWN"
    NO_DRIVER = "NO_DRIVER"
    CPU_ABOVE_CAPACITY = "CPU_ABOVE_CAPACITY"
    MEMORY_ABOVE_CAPACITY = "MEMORY_ABOVE_CAPACITY"
    INSUFFICIENT_CPU = "INSUFFICIENT_CPU"
    INSUFFICIENT_MEMORY = "INSUFFICIENT_MEMORY"
    HOST_PORT_IN_USE = "HOST_PORT_IN_USE"
    NODE_SELECTOR_MISMATCH = "NODE_SELECTOR_MISMATCH"
    SPREAD_LIMIT = "SPREAD_LIMIT"
    OFFER_REFUSED = "OFFER_REFUSED"
    OFFER_TIMED_OUT = "OFFER_TIMED_OUT"
    POOL_MISMATCH = "POOL_MISMATCH"
    CLASS_UNSUPPORTED = "CLASS_UNSUPPORTED"
    VOLUME_ELSEWHERE = "VOLUME_ELSEWHERE"
    VOLUME_POOL = "VOLUME_POOL"
    VOLUME_BACKEND = "VOLUME_BACKEND"
    VOLUME_TOO_BIG = "VOLUME_TOO_BIG"


# Whether waiting can help, per code. Only a change to the cluster's shape (a node joining, a
# node's drivers, labels or capacity changing) or to the workload's spec fixes the others.
RESOLVABLE: Mapping[Code, bool] = {
    Code.NODE_NOT_READY: True,  # heartbeats may resume
    Code.NODE_LOST: True,  # the agent may come back
    Code.NODE_LEFT: True,  # ... or rejoin
    Code.NODE_GONE: True,
    Code.NODE_CORDONED: True,  # uncordon
    Code.NODE_SHUTTING_DOWN: True,
    Code.NO_DRIVER: False,
    Code.CPU_ABOVE_CAPACITY: False,
    Code.MEMORY_ABOVE_CAPACITY: False,
    Code.INSUFFICIENT_CPU: True,  # instances end and free room
    Code.INSUFFICIENT_MEMORY: True,
    Code.HOST_PORT_IN_USE: True,  # the instance holding the port may end
    Code.NODE_SELECTOR_MISMATCH: False,
    Code.SPREAD_LIMIT: True,  # a replica on that node may end
    # An agent's own check (image present, disk free, driver healthy) may pass later.
    Code.OFFER_REFUSED: True,
    Code.OFFER_TIMED_OUT: True,
    # A node joins a pool when its agent registers: only a node (re)joining changes it.
    Code.POOL_MISMATCH: False,
    # Even empty, the node cannot hold the class's shape: like CPU_ABOVE_CAPACITY, but named
    # after the class the user asked for.
    Code.CLASS_UNSUPPORTED: False,
    # The node holding the volume may be down, cordoned or full now, and come back.
    Code.VOLUME_ELSEWHERE: True,
    # A node's pool, volume backends and volume capacity are its shape: only a change of
    # shape (or of the volume) helps.
    Code.VOLUME_POOL: False,
    Code.VOLUME_BACKEND: False,
    Code.VOLUME_TOO_BIG: False,
}


@dataclass(frozen=True, slots=True, eq=False)
class Reason:
    """Why one node cannot take one instance.

    Interned: `reason()` (which every constant and factory here goes through) gives one object
    per code and message, so reasons compare and hash by identity, at C speed. A decision that
    rejects 5,000 nodes counts each under its reason in a dict.
    """

    code: Code
    message: str
    resolvable: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "resolvable", RESOLVABLE[self.code])

    def __str__(self) -> str:
        return self.message


_INTERNED: dict[tuple[Code, str], Reason] = {}
# Messages can carry label values and agents' words; past this many, start over (a reason
# made twice then counts the same anyway: count_reasons merges by code and message).
_MAX_INTERNED = 4096


def reason(code: Code, message: str) -> Reason:
    """The one Reason for this code and message."""
    key = (code, message)
    found = _INTERNED.get(key)
    if found is None:
        if len(_INTERNED) >= _MAX_INTERNED:
            _INTERNED.clear()
        found = _INTERNED[key] = Reason(code, message)
    return found


NOT_READY = reason(Code.NODE_NOT_READY, "not ready")
LOST = reason(Code.NODE_LOST, "lost")
LEFT = reason(Code.NODE_LEFT, "left")
GONE = reason(Code.NODE_GONE, "gone")
CORDONED = reason(Code.NODE_CORDONED, "cordoned")
SHUTTING_DOWN = reason(Code.NODE_SHUTTING_DOWN, "node is shutting down")
CPU_ABOVE_CAPACITY = reason(Code.CPU_ABOVE_CAPACITY, "cpu request exceeds node capacity")
MEMORY_ABOVE_CAPACITY = reason(Code.MEMORY_ABOVE_CAPACITY, "memory request exceeds node capacity")
INSUFFICIENT_CPU = reason(Code.INSUFFICIENT_CPU, "insufficient cpu")
INSUFFICIENT_MEMORY = reason(Code.INSUFFICIENT_MEMORY, "insufficient memory")
OFFER_TIMED_OUT = reason(Code.OFFER_TIMED_OUT, "offer timed out")

_STATES: Mapping[NodeState, Reason] = {
    NodeState.NOT_READY: NOT_READY,
    NodeState.LOST: LOST,
    NodeState.LEFT: LEFT,
}


# The parametrised reasons are cached too: a decision that rejects 5,000 nodes for "no libvirt
# driver" formats the message once.
@functools.lru_cache(maxsize=64)
def no_driver(driver: str) -> Reason:
    return reason(Code.NO_DRIVER, f"no {driver} driver")


@functools.lru_cache(maxsize=1024)
def selector_mismatch(key: str, want: str) -> Reason:
    # Naming the first key that differs tells the user which label to fix; nodes that miss the
    # same key aggregate into one line of the unschedulable reason.
    return reason(Code.NODE_SELECTOR_MISMATCH, f"label {key} != {want}")


@functools.lru_cache(maxsize=256)
def spread_limit(count: int) -> Reason:
    noun = "replica" if count == 1 else "replicas"
    return reason(Code.SPREAD_LIMIT, f"spread: {count} {noun} already on node")


@functools.lru_cache(maxsize=1024)
def host_port_in_use(port: int, protocol: PortProtocol) -> Reason:
    # tcp is what nearly every port is, so only udp is spelled out ("host port 53/udp in use").
    name = str(port) if protocol is PortProtocol.TCP else f"{port}/{protocol.value}"
    return reason(Code.HOST_PORT_IN_USE, f"host port {name} in use")


@functools.lru_cache(maxsize=256)
def pool_mismatch(pool: str) -> Reason:
    # The node's pool, not the wanted one: nodes of the same other pool aggregate into one line.
    return reason(Code.POOL_MISMATCH, f"node is in pool {pool}")


@functools.lru_cache(maxsize=256)
def class_unsupported(class_name: str) -> Reason:
    return reason(Code.CLASS_UNSUPPORTED, f"cannot host class {class_name}")


@functools.lru_cache(maxsize=1024)
def volume_elsewhere(volume: str, node: str) -> Reason:
    return reason(Code.VOLUME_ELSEWHERE, f"volume {volume} lives on {node}")


@functools.lru_cache(maxsize=256)
def volume_pool(volume: str, pool: str) -> Reason:
    return reason(Code.VOLUME_POOL, f"volume {volume} needs pool {pool}")


@functools.lru_cache(maxsize=16)
def volume_backend(backend: str) -> Reason:
    return reason(Code.VOLUME_BACKEND, f"no {backend} volumes on this node")


@functools.lru_cache(maxsize=256)
def volume_too_big(volume: str) -> Reason:
    return reason(Code.VOLUME_TOO_BIG, f"volume {volume} is larger than the node's volume space")


def refused(why: str) -> Reason:
    """An agent said no to an offer; `why` is its own words."""
    return reason(Code.OFFER_REFUSED, f"refused: {why}")


# ---- the rule ----

# A fixed host port as a node resource: (port, protocol). One instance on a node binds it.
HostPort = tuple[int, PortProtocol]
NO_HOST_PORTS: frozenset[HostPort] = frozenset()


@dataclass(frozen=True, slots=True)
class VolumeNeed:
    """One volume an instance uses, as placement sees it: where it lives (`node`, once bound)
    or, while unbound, what a node needs to create it (pool, backend, room)."""

    name: str
    size_bytes: int
    backend: str
    node: str = ""
    pool: str = ""


NO_VOLUMES: tuple[VolumeNeed, ...] = ()


class Amount(Protocol):
    """Resources asked for (a spec's Resources)."""

    @property
    def cpu_millis(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...


class Ports(Protocol):
    """Fixed host ports asked for (a spec's `fixed_host_ports`; empty for most)."""

    @property
    def host_ports(self) -> Collection[HostPort]: ...


class Need(Amount, Ports, Protocol):
    """What an instance asks of a node (the scheduler's PlacementRequest)."""

    @property
    def workload(self) -> str: ...
    @property
    def kind(self) -> WorkloadKind: ...
    @property
    def node_selector(self) -> Mapping[str, str]: ...
    @property
    def max_per_node(self) -> int: ...
    @property
    def pool(self) -> str: ...
    @property
    def class_name(self) -> str: ...
    def volumes(self) -> tuple[VolumeNeed, ...]: ...


class Capacity(Protocol):
    """A node's resources: what it offers and what is used or reserved of it (`Room`)."""

    @property
    def cpu_allocatable(self) -> int: ...
    @property
    def mem_allocatable(self) -> int: ...
    @property
    def cpu_used(self) -> int: ...
    @property
    def mem_used(self) -> int: ...
    @property
    def host_ports(self) -> Collection[HostPort]:
        """Fixed host ports taken by the instances assigned to, reserved on or running on it."""
        ...


class Offer(Capacity, Protocol):
    """What a node offers (the scheduler's NodeView)."""

    @property
    def state(self) -> NodeState: ...
    @property
    def schedulable(self) -> bool: ...
    @property
    def drivers(self) -> Collection[str]: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def workload_counts(self) -> Mapping[str, int]: ...
    @property
    def name(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def volume_backends(self) -> Collection[str]: ...
    @property
    def volume_capacity_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Room:
    """A node's resources as its agent counts them, for `resources` and `explain_resources`."""

    cpu_allocatable: int
    mem_allocatable: int
    cpu_used: int
    mem_used: int
    host_ports: Collection[HostPort] = NO_HOST_PORTS


def fit(need: Need, node: Offer) -> Reason | None:
    """The whole rule: None when the node can take the instance, else the first reason not.

    The order is the precedence of reasons users see: a lost node reports "lost", not
    "insufficient cpu"; a node the selector rules out names the label (no waiting helps), not
    a host port taken. The scheduler's filters are these aspects one by one, in this order.
    """
    return (
        ready(need, node)
        or schedulable(need, node)
        or pool(need, node)
        or driver(need, node)
        or class_fit(need, node)
        or resources(need, node)
        or selector(need, node)
        or host_ports(need, node)
        or spread(need, node)
        or volumes(need, node)
    )


def availability(node: Offer) -> Reason | None:
    """What is asked of a node whatever the request: READY and schedulable."""
    state = node.state
    if state is not NodeState.READY:
        # A state added later must still reject, with a reason that names it.
        return _STATES.get(state) or reason(Code.NODE_NOT_READY, state.value.lower())
    return None if node.schedulable else CORDONED


def ready(need: Need, node: Offer) -> Reason | None:
    """Only READY nodes take new instances; the reason names the state."""
    state = node.state
    if state is NodeState.READY:
        return None
    return _STATES.get(state) or reason(Code.NODE_NOT_READY, state.value.lower())


def schedulable(need: Need, node: Offer) -> Reason | None:
    """Cordoned and draining nodes keep their instances but take no new ones."""
    return None if node.schedulable else CORDONED


def driver(need: Need, node: Offer) -> Reason | None:
    """The node has the runtime driver the kind needs (`fake` stands in for any)."""
    wanted = KIND_DRIVER[need.kind]
    drivers = node.drivers
    if wanted in drivers or FAKE_DRIVER in drivers:
        return None
    return no_driver(wanted)


def pool(need: Need, node: Offer) -> Reason | None:
    """A request that names a pool goes only to nodes of that pool."""
    wanted = need.pool
    if not wanted or node.pool == wanted:
        return None
    return pool_mismatch(node.pool)


def class_fit(need: Need, node: Offer) -> Reason | None:
    """A request of a COMPUTE class goes only to nodes that could hold it empty: the
    class's name, not a bare "cpu request exceeds node capacity", tells the user what to
    change (its resources are the class's, resolved by the controller)."""
    name = need.class_name
    if not name:
        return None
    if need.cpu_millis > node.cpu_allocatable or need.memory_bytes > node.mem_allocatable:
        return class_unsupported(name)
    return None


def resources(need: Amount, node: Capacity) -> Reason | None:
    """The request fits in what the node has left (allocatable minus used and reserved).

    A request bigger than the whole allocatable is named as such: no amount of waiting makes it
    fit. CPU is named before memory so the same shortage always yields the same reason. Even a
    zero request is checked: a node whose allocatable shrank below its usage is full.
    """
    cpu, mem = need.cpu_millis, need.memory_bytes
    cpu_alloc, mem_alloc = node.cpu_allocatable, node.mem_allocatable
    if cpu > cpu_alloc:
        return CPU_ABOVE_CAPACITY
    if mem > mem_alloc:
        return MEMORY_ABOVE_CAPACITY
    if cpu > cpu_alloc - node.cpu_used:
        return INSUFFICIENT_CPU
    if mem > mem_alloc - node.mem_used:
        return INSUFFICIENT_MEMORY
    return None


def host_ports(need: Ports, node: Capacity) -> Reason | None:
    """None of the request's fixed host ports is taken on the node (Kubernetes' NodePorts).

    A request without fixed host ports (host_port 0: the agent picks one) asks nothing of the
    node, and is answered before the node is even looked at.
    """
    wanted = need.host_ports
    if not wanted:
        return None
    return ports_taken(wanted, node.host_ports)


def ports_taken(wanted: Collection[HostPort], used: Collection[HostPort]) -> Reason | None:
    """The reason when one of `wanted` is in `used`: the lowest such port is named, so the same
    collision always reads the same."""
    if not wanted or not used:
        return None
    taken = [p for p in wanted if p in used]
    if not taken:
        return None
    port, protocol = min(taken)
    return host_port_in_use(port, protocol)


def most_used_that_fits(share: float) -> float:
    """The largest cpu_used/cpu_alloc + mem_used/mem_alloc a node may have and still take a
    request whose shares of the node, cpu/cpu_alloc + mem/mem_alloc, sum to `share`.

    A corollary of `resources`: fitting needs each used share plus the request's share to be at
    most 1, so their sum is at most 2. The index skips every node above this bound unchecked.
    """
    return 2.0 - share


def selector(need: Need, node: Offer) -> Reason | None:
    """Every label of the node selector is on the node with exactly that value."""
    labels = node.labels
    for key, want in need.node_selector.items():
        if labels.get(key) != want:
            return selector_mismatch(key, want)
    return None


def spread(need: Need, node: Offer) -> Reason | None:
    """At most `max_per_node` instances of the workload per node; 0 means no limit."""
    limit = need.max_per_node
    if limit <= 0:
        return None
    count = node.workload_counts.get(need.workload, 0)
    return None if count < limit else spread_limit(count)


def volumes(need: Need, node: Offer) -> Reason | None:
    """Every volume the instance uses can be used on the node: a bound one only on its node
    (local storage: its data is there), an unbound one on a node of its pool that offers its
    backend and has room for its size. The first volume that rules the node out is named."""
    for v in need.volumes:
        if v.node:
            if v.node != node.name:
                return volume_elsewhere(v.name, v.node)
            continue
        if v.pool and v.pool != node.pool:
            return volume_pool(v.name, v.pool)
        if v.backend not in node.volume_backends:
            return volume_backend(v.backend)
        if v.size_bytes > node.volume_capacity_bytes:
            return volume_too_big(v.name)
    return None


def explain_resources(r: Reason, need: Amount, node: Capacity) -> str:
    """A resource reason with the figures behind it, for a node's own refusal."""
    cpu, mem = need.cpu_millis, need.memory_bytes
    if r is CPU_ABOVE_CAPACITY:
        return f"{r}: {cpu}m requested, {node.cpu_allocatable}m capacity"
    if r is MEMORY_ABOVE_CAPACITY:
        return f"{r}: {_mib(mem)} requested, {_mib(node.mem_allocatable)} capacity"
    if r is INSUFFICIENT_CPU:
        return f"{r}: {cpu}m requested, {node.cpu_allocatable - node.cpu_used}m free"
    if r is INSUFFICIENT_MEMORY:
        return f"{r}: {_mib(mem)} requested, {_mib(node.mem_allocatable - node.mem_used)} free"
    return r.message


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}Mi"


# ---- what the users see: reasons counted over the nodes of one decision ----


@dataclass(frozen=True, slots=True)
class ReasonCount:
    """One line of an unschedulable instance's explanation: a reason and how many nodes gave it."""

    code: str
    message: str
    node_count: int
    resolvable: bool


def count_reasons(rejections: Mapping[Reason, int]) -> list[ReasonCount]:
    """One line per code and message, most common first, then by message, so the same
    refusals always read the same."""
    merged: dict[tuple[Code, str], int] = {}
    for r, n in rejections.items():
        key = (r.code, r.message)
        merged[key] = merged.get(key, 0) + n
    parts = sorted(merged.items(), key=lambda item: (-item[1], item[0][1]))
    return [ReasonCount(code.value, message, n, RESOLVABLE[code]) for (code, message), n in parts]


def format_reasons(counts: Iterable[ReasonCount]) -> str:
    """'3 nodes: insufficient memory; 1 node: cordoned'; "no nodes" when there were none."""
    text = "; ".join(
        f"{c.node_count} {'node' if c.node_count == 1 else 'nodes'}: {c.message}" for c in counts
    )
    return text or "no nodes"


def unresolvable(counts: Collection[ReasonCount]) -> bool:
    """Every node refused for a reason waiting cannot fix (and there was at least one node)."""
    return bool(counts) and not any(c.resolvable for c in counts)
