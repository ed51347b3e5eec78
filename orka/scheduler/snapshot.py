"""The immutable picture of the cluster that one placement decision works on.

The node registry builds a new `Snapshot` whenever the cluster changes; the pipeline only ever
reads it, so a decision can never see a half-applied heartbeat or reservation. Nothing in here
changes after construction, not even a cache: what one decision works out lives in that
decision's own context (orka.scheduler.pipeline.Decision). Everything here is
a slots dataclass with plain attributes because the filters read them once per node per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, TypeVar

from orka.fit import NO_HOST_PORTS, NO_VOLUMES, HostPort, VolumeNeed
from orka.models import DEFAULT_POOL, NodeState, WorkloadKind

if TYPE_CHECKING:
    from orka.scheduler.index import SnapshotIndex

V = TypeVar("V")

# How much of a filter's work an index of the snapshot's nodes already did (see Filter).
IndexScope = Literal["passed", "bucket", "node"]


def _frozen_mapping(value: Mapping[str, V]) -> Mapping[str, V]:
    # A caller's dict could be mutated after the snapshot is built; a private read-only copy
    # keeps the snapshot honest for as long as anyone holds it. A proxy is already read-only
    # (its owner is whoever built it, normally another snapshot), so it is shared, not copied.
    if isinstance(value, MappingProxyType):
        return value
    return MappingProxyType(dict(value))


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    state: NodeState
    schedulable: bool
    drivers: frozenset[str]
    labels: Mapping[str, str]
    # What the node offers to instances.
    cpu_allocatable: int
    mem_allocatable: int
    # Allocated plus reserved by in-flight offers, so two decisions cannot both take the last slot.
    cpu_used: int
    mem_used: int
    # Instances (reservations included) per workload on this node.
    workload_counts: Mapping[str, int]
    total_instances: int
    # Fixed host ports its instances (reservations included) bind: a node resource.
    host_ports: frozenset[HostPort] = NO_HOST_PORTS
    # Where new volumes may be created on it: its pool, backends and volume space.
    pool: str = DEFAULT_POOL
    volume_backends: frozenset[str] = frozenset()
    volume_capacity_bytes: int = 0

    def __post_init__(self) -> None:
        # object.__setattr__ is the only way to normalise fields of a frozen dataclass.
        if not isinstance(self.drivers, frozenset):
            object.__setattr__(self, "drivers", frozenset(self.drivers))
        if not isinstance(self.volume_backends, frozenset):
            object.__setattr__(self, "volume_backends", frozenset(self.volume_backends))
        if not isinstance(self.host_ports, frozenset):
            object.__setattr__(self, "host_ports", frozenset(self.host_ports))
        object.__setattr__(self, "labels", _frozen_mapping(self.labels))
        object.__setattr__(self, "workload_counts", _frozen_mapping(self.workload_counts))

    @property
    def cpu_free(self) -> int:
        return self.cpu_allocatable - self.cpu_used

    @property
    def mem_free(self) -> int:
        return self.mem_allocatable - self.mem_used


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Snapshot:
    nodes: tuple[NodeView, ...]
    # The index of these nodes (orka.scheduler.index) when whoever built the snapshot had one:
    # the registry carries it over from the previous snapshot change by change. Derived from
    # `nodes`, so it is left out of comparisons.
    index: SnapshotIndex | None = field(default=None, repr=False, compare=False)
    by_name: Mapping[str, NodeView] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        by_name = {n.name: n for n in nodes}
        if len(by_name) != len(nodes):
            # Ties are broken by node name, so a duplicate would make rankings ambiguous.
            raise ValueError("snapshot node names must be unique")
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "by_name", MappingProxyType(by_name))

    @classmethod
    def of(cls, nodes: Iterable[NodeView], index: SnapshotIndex | None = None) -> Snapshot:
        return cls(tuple(nodes), index)

    @classmethod
    def from_views(
        cls, by_name: dict[str, NodeView], index: SnapshotIndex | None = None
    ) -> Snapshot:
        """A snapshot of `by_name`'s views in its order, taking ownership of the dict.

        The caller hands over a dict nobody else will change (names are unique by construction),
        so the per-node checks and the name map of the constructor are skipped: this is the
        registry's path, which builds one snapshot per reservation.
        """
        snap = object.__new__(cls)
        set_ = object.__setattr__
        set_(snap, "nodes", tuple(by_name.values()))
        set_(snap, "by_name", MappingProxyType(by_name))
        set_(snap, "index", index)
        return snap

    def __len__(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    instance: str
    workload: str
    kind: WorkloadKind
    cpu_millis: int
    memory_bytes: int
    node_selector: Mapping[str, str] = field(default_factory=dict)
    # Spread rule: at most this many instances of the workload per node; 0 means no limit.
    max_per_node: int = 0
    # The fixed host ports the instance binds (the spec's `fixed_host_ports`).
    host_ports: frozenset[HostPort] = NO_HOST_PORTS
    # Only nodes of this pool ("": any), and the COMPUTE class its resources came from ("":
    # none), named in the reason when no node could ever host it.
    pool: str = ""
    class_name: str = ""
    # The volumes it uses (the assignment's), bound to a node or not yet.
    volumes: tuple[VolumeNeed, ...] = NO_VOLUMES

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_selector", _frozen_mapping(self.node_selector))
        if not isinstance(self.host_ports, frozenset):
            object.__setattr__(self, "host_ports", frozenset(self.host_ports))
