"""What the controller asks of the scheduler and hears back from it, as domain values.

The reconciler and the placement queue build and read these; `orka/controller/link.py` is the
one place that turns them into protobuf messages and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orka.models import (
    Instance,
    InstanceReport,
    Node,
    VolumeAttachment,
    VolumeReport,
    Workload,
    WorkloadSpec,
)


@dataclass(frozen=True)
class Assignment:
    """What a node is told to run for one instance; the same for offers and starts."""

    instance: str
    generation: int
    spec: WorkloadSpec
    # The volumes it uses, resolved by the controller (orka/controller/volume_plan.py).
    volumes: tuple[VolumeAttachment, ...] = ()
    ordinal: int = 0

    @classmethod
    def of(
        cls, inst: Instance, w: Workload, volumes: tuple[VolumeAttachment, ...] = ()
    ) -> Assignment:
        return cls(
            instance=inst.name,
            generation=inst.generation,
            spec=w.spec,
            volumes=volumes,
            ordinal=inst.ordinal,
        )


@dataclass(frozen=True)
class Start:
    """Start a bound instance on its node."""

    node: str
    assignment: Assignment

    @property
    def instance(self) -> str:
        return self.assignment.instance


@dataclass(frozen=True)
class Stop:
    """Stop an instance on a node and remove what it left there (task, logs)."""

    node: str
    instance: str
    reason: str


@dataclass(frozen=True)
class Release:
    """Give back the reservation of an offer the controller could not bind."""

    node: str
    instance: str


@dataclass(frozen=True)
class ProvisionVolume:
    """Make a volume on its node now (a class with `immediate`), before any instance uses it."""

    node: str
    volume: VolumeAttachment


@dataclass(frozen=True)
class DeleteVolume:
    """Delete a volume and its data from its node (refused there while an instance holds it)."""

    node: str
    volume: str


NodeCommand = Start | Stop | Release | ProvisionVolume | DeleteVolume


def start_command(inst: Instance, w: Workload, volumes: tuple[VolumeAttachment, ...] = ()) -> Start:
    return Start(node=inst.node, assignment=Assignment.of(inst, w, volumes))


def stop_command(node: str, instance: str, reason: str) -> Stop:
    return Stop(node=node, instance=instance, reason=reason)


# ---- the cluster feed: what the scheduler says changed ----
# One per feed message, thousands a second under churn: plain slotted classes, which build in a
# third of the time of frozen ones. Nothing changes them after the link built them.


@dataclass(slots=True)
class NodeSeen:
    """A node's record as the scheduler now sees it."""

    node: Node


@dataclass(slots=True)
class InstanceReported:
    """A node's report of one instance (a state change)."""

    report: InstanceReport


@dataclass(slots=True)
class NodeSynced:
    """A node (re-)registered: everything it runs. An instance bound there and not in the list
    no longer runs there."""

    node: str
    reports: list[InstanceReport] = field(default_factory=list)
    # Every volume it holds (orka/controller/volumes.py): one not listed is not there.
    volumes: list[VolumeReport] = field(default_factory=list)


@dataclass(slots=True)
class VolumeReported:
    """A node's report of one of its volumes (a state change)."""

    node: str
    report: VolumeReport


ClusterUpdate = NodeSeen | InstanceReported | NodeSynced | VolumeReported
