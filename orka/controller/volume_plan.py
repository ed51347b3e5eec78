"""Volumes in placement: what an instance's assignment says about each volume it uses, why an
instance must wait for one, how accepting a node binds them, and which replica (ordinal) a new
instance is.

A volume is local storage: once bound to a node, every instance that uses it goes there, and
the agent provisions it before the instance starts. The controller decides the binding in the
same write that binds the instance, so a volume is never bound to two nodes.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from orka.etags import new_workload_etag
from orka.models import (
    DEFAULT_POOL,
    Class,
    Instance,
    Node,
    Volume,
    VolumeAttachment,
    VolumeSpec,
    VolumeState,
    Workload,
    WorkloadKind,
    WorkloadSpec,
    backend_for,
)

# Volumes no instance may be placed with: their data is going, broken or gone with its node.
_UNUSABLE = {
    VolumeState.DELETING: "is being deleted",
    VolumeState.FAILED: "failed",
    VolumeState.LOST: "is lost",
}
# What an instance created by a template says it was made by.
TEMPLATE_CREATOR = "controller"


@dataclass(frozen=True)
class Resolved:
    """The volumes of one instance as its assignment carries them, or why it must wait."""

    attachments: tuple[VolumeAttachment, ...] = ()
    # Non-empty: the instance stays PENDING with this message (VolumeUnavailable).
    wait: str = ""
    # The volumes named (by attachment order), for wake-ups when one of them changes.
    names: tuple[str, ...] = field(default=())


def resolve(
    inst: Instance,
    w: Workload,
    volumes: Mapping[str, Volume],
    classes: Mapping[str, Class],
) -> Resolved:
    """The instance's VolumeAttachments: spec.volumes in order, then its template's volume.

    `node` is set for a volume that already lives on a node (the instance must go there); a
    template volume not made yet is described from the template and made when the instance
    is bound (bind_volumes)."""
    spec = w.spec
    out: list[VolumeAttachment] = []
    names = tuple(m.volume for m in spec.volumes) + (
        (spec.volume_template.volume_name(w.name, inst.ordinal),) if spec.volume_template else ()
    )
    for m in spec.volumes:
        vol = volumes.get(m.volume)
        if vol is None:
            return Resolved(wait=f"volume {m.volume} does not exist", names=names)
        why = _unusable(vol)
        if why:
            return Resolved(wait=why, names=names)
        out.append(
            VolumeAttachment(
                name=m.volume,
                size_bytes=vol.spec.size_bytes,
                backend=_backend(vol, vol.spec.class_name, classes, spec),
                node=vol.node,
                pool=vol.pool or vol.spec.pool,
                mount_path=m.mount_path,
                read_only=m.read_only,
                env_name=m.volume,
            )
        )
    t = spec.volume_template
    if t is not None:
        name = t.volume_name(w.name, inst.ordinal)
        vol = volumes.get(name)
        if vol is not None:
            # A RELEASED one is a workload's of that name that was deleted: ours again.
            released = vol.state is VolumeState.RELEASED and not vol.workload
            if vol.workload != w.name and not released:
                owner = f"workload {vol.workload}" if vol.workload else "a user"
                return Resolved(
                    wait=f"volume {name} exists and was made by {owner}, not by this workload",
                    names=names,
                )
            why = _unusable(vol)
            if why:
                return Resolved(wait=why, names=names)
        out.append(
            VolumeAttachment(
                name=name,
                size_bytes=vol.spec.size_bytes if vol is not None else t.size_bytes,
                backend=_backend(vol, t.class_name, classes, spec),
                node=vol.node if vol is not None else "",
                # A replica's volume goes where the workload asks to run.
                pool=(vol.pool or vol.spec.pool) if vol is not None else spec.pool,
                mount_path=t.mount_path,
                read_only=t.read_only,
                env_name=t.name,
            )
        )
    return Resolved(attachments=tuple(out), names=names)


def _unusable(vol: Volume) -> str:
    what = _UNUSABLE.get(vol.state)
    if what is None:
        return ""
    text = f"volume {vol.name} {what}"
    if vol.state is VolumeState.LOST and vol.node:
        text += f" with node {vol.node}"
    if vol.message:
        text += f": {vol.message}"
    return text


def _backend(
    vol: Volume | None, class_name: str, classes: Mapping[str, Class], spec: WorkloadSpec
) -> str:
    """The volume's backend, else its class's only one, else what the workload's kind uses."""
    if vol is not None and (vol.backend or vol.spec.backend):
        return vol.backend or vol.spec.backend
    cls = classes.get(class_name) if class_name else None
    if cls is not None and cls.volume is not None and len(cls.volume.backends) == 1:
        return cls.volume.backends[0]
    return backend_for(spec.kind)


def single_user_busy(
    inst: Instance,
    atts: Iterable[VolumeAttachment],
    volumes: Mapping[str, Volume],
    siblings: Iterable[Instance],
    spec_of: Mapping[str, Collection[str]],
) -> str:
    """Why the instance must wait for a qcow2 disk another live instance holds ("" if none):
    a disk serves one running VM at a time. `siblings` are the workload's other instances and
    `spec_of` the volumes each of them uses (by instance name)."""
    for a in atts:
        if a.backend != "qcow2":
            continue
        vol = volumes.get(a.name)
        holders = [h for h in (vol.attached_to if vol is not None else ()) if h != inst.name]
        holders += [
            s.name
            for s in siblings
            if s.name != inst.name
            and s.node
            and not s.terminal
            and a.name in spec_of.get(s.name, ())
            and s.name not in holders
        ]
        if holders:
            return f"volume {a.name} is in use by {', '.join(sorted(holders)[:3])}"
    return ""


def bind_volumes(
    inst: Instance,
    w: Workload,
    atts: Iterable[VolumeAttachment],
    node: Node | None,
    node_name: str,
    volumes: Mapping[str, Volume],
) -> list[Volume] | None:
    """The volume records that change when `inst` is bound to `node_name`: unbound volumes are
    bound there, a template volume is made (or taken back from RELEASED). None when a volume is
    already bound elsewhere: the binding must not happen."""
    now = time.time()
    pool = node.pool if node is not None else DEFAULT_POOL
    out: list[Volume] = []
    t = w.spec.volume_template
    template_name = t.volume_name(w.name, inst.ordinal) if t is not None else ""
    for a in atts:
        vol = volumes.get(a.name)
        if vol is not None and vol.node and vol.node != node_name:
            return None
        update: dict[str, object] = {}
        if vol is None:
            if a.name != template_name or t is None:
                return None  # a named volume deleted meanwhile: nothing to bind to
            vol = Volume(
                spec=VolumeSpec(
                    name=a.name,
                    size_bytes=t.size_bytes,
                    class_name=t.class_name,
                    pool=w.spec.pool,
                ),
                workload=w.name,
                ordinal=inst.ordinal,
                created_by=TEMPLATE_CREATOR,
                created_at=now,
            )
            update = {"node": node_name, "pool": pool, "backend": a.backend}
        elif not vol.node:
            update = {"node": node_name, "pool": pool, "backend": a.backend}
        if vol.state is VolumeState.RELEASED and a.name == template_name:
            # The workload is back (re-created): its replica takes its volume again.
            update["state"] = VolumeState.AVAILABLE if vol.node else VolumeState.PENDING
            update["workload"] = w.name
        if update:
            update |= {"updated_at": now, "etag": new_workload_etag()}
            out.append(vol.model_copy(update=update))
    return out


def volume_names(spec: WorkloadSpec, workload: str, ordinal: int) -> tuple[str, ...]:
    """The volumes an instance of `spec` with `ordinal` uses."""
    names = tuple(m.volume for m in spec.volumes)
    if spec.volume_template is not None:
        names += (spec.volume_template.volume_name(workload, ordinal),)
    return names


def one_at_a_time(spec: WorkloadSpec) -> bool:
    """A VM with volumes: its disks serve one running VM each, so a replica's successor can
    only start once its predecessor stopped (no surge in a rollout)."""
    return spec.kind is WorkloadKind.VM and bool(spec.volumes or spec.volume_template)


class Ordinals:
    """Hands out replica ordinals: each new instance takes the lowest one not used by the
    workload's live instances of its generation (nor handed out before in this pass).

    With `any_generation`, instances of every generation count: a rollout that stops an old
    replica before starting its successor (one_at_a_time) gives the successor the stopped
    replica's ordinal, and so its volume, instead of one an old replica still holds."""

    def __init__(
        self, insts: Iterable[Instance], generation: int, any_generation: bool = False
    ) -> None:
        self.used = {
            i.ordinal
            for i in insts
            if (any_generation or i.generation == generation)
            and not i.terminal
            and not i.desired_stop
        }

    def take(self) -> int:
        n = 0
        while n in self.used:
            n += 1
        self.used.add(n)
        return n
