"""The immutable picture of the cluster that one placement decision works on.

The node registry builds a new `Snapshot` whenever the cluster changes; the pipeline only ever
reads it, so a decision can never see a half-applied heartbeat or reservation. Nothing in here
changes after construction (a snapshot makes its `nodes` tuple from its own views when first
asked, the same every time): what one decision works out lives in that decision's own context
(orka.scheduler.pipeline.Decision). Everything here has slots and plain attributes because the
filters read them once per node per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import FrozenInstanceError, dataclass, field
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


class Layered(Mapping[str, NodeView]):
    """Views by name: `top`'s over `base`'s, in `base`'s order, with `base`'s names (`top`
    only replaces). Whoever builds one hands over both dicts and changes neither after.

    The registry's snapshots share one base and each copies only the views changed since it
    was taken: a reservation changes one node, and copying every view for each of thousands
    of reservations a second was most of what a snapshot cost on a large cluster."""

    __slots__ = ("_base", "_top")

    def __init__(self, base: dict[str, NodeView], top: dict[str, NodeView]) -> None:
        self._base = base
        self._top = top

    def __getitem__(self, name: str) -> NodeView:
        view = self._top.get(name)
        return self._base[name] if view is None else view

    def __contains__(self, name: object) -> bool:
        return name in self._base

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    def views(self) -> tuple[NodeView, ...]:
        top = self._top
        if not top:
            return tuple(self._base.values())
        return tuple(top.get(name) or view for name, view in self._base.items())


class Snapshot:
    """The nodes one decision ranks: immutable once built. `by_name` maps names to views;
    `nodes` is the same views in order (registration order, from the registry), made when
    first asked for: the indexed ranking reads only the index, so most decisions never do."""

    __slots__ = ("__weakref__", "_nodes", "by_name", "index")

    # The index of these nodes (orka.scheduler.index) when whoever built the snapshot had one:
    # the registry carries it over from the previous snapshot change by change. Derived from
    # the nodes, so it is left out of comparisons.
    index: SnapshotIndex | None
    by_name: Mapping[str, NodeView]

    def __init__(self, nodes: Iterable[NodeView], index: SnapshotIndex | None = None) -> None:
        nodes = tuple(nodes)
        by_name = {n.name: n for n in nodes}
        if len(by_name) != len(nodes):
            # Ties are broken by node name, so a duplicate would make rankings ambiguous.
            raise ValueError("snapshot node names must be unique")
        _set(self, "_nodes", nodes)
        _set(self, "by_name", MappingProxyType(by_name))
        _set(self, "index", index)

    @classmethod
    def of(cls, nodes: Iterable[NodeView], index: SnapshotIndex | None = None) -> Snapshot:
        return cls(tuple(nodes), index)

    @classmethod
    def layered(cls, by_name: Layered, index: SnapshotIndex | None = None) -> Snapshot:
        """A snapshot of `by_name` (names are unique by construction): the registry's path,
        one snapshot per reservation, so it skips the constructor's checks and copies."""
        snap = object.__new__(cls)
        _set(snap, "_nodes", None)
        _set(snap, "by_name", by_name)
        _set(snap, "index", index)
        return snap

    @property
    def nodes(self) -> tuple[NodeView, ...]:
        nodes: tuple[NodeView, ...] | None = self._nodes
        if nodes is None:
            by_name = self.by_name
            assert isinstance(by_name, Layered)
            nodes = by_name.views()
            _set(self, "_nodes", nodes)
        return nodes

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"a snapshot is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"a snapshot is immutable: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return self.nodes == other.nodes

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Snapshot(nodes={self.nodes!r})"

    def __len__(self) -> int:
        return len(self.by_name)


_set = object.__setattr__


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
