"""Volumes on the wire: the public Volume and VolumeSpec, and what agents report of theirs as
the scheduler and controller check it.

Beside orka/rpc/convert.py, which holds the rest. What an agent reports is input like a user's
and is checked here (names, sizes, bounded text); what the agent sends and is sent (its reports,
the attachments of an assignment) is written here too.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import ValidationError

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import Invalid
from orka.models import (
    DEFAULT_POOL,
    MAX_VOLUME_BYTES,
    VOLUME_BACKENDS,
    Volume,
    VolumeAttachment,
    VolumeReport,
    VolumeSpec,
    VolumeState,
    check_name,
)
from orka.rpc.convert import invalid_from, seconds_from_pb, timestamp_fields
from orka.validation import quote

_STATE_TO_PB = {state: pb.Volume.State.Value(state.value) for state in VolumeState}
_STATE_FROM_PB = {number: state for state, number in _STATE_TO_PB.items()}

# Bounds on what an agent reports of one volume, and on how many it may hold.
MAX_VOLUME_MESSAGE = 4096
MAX_ATTACHED = 256
MAX_NODE_VOLUMES = 4096
MAX_INSTANCE_NAME = 253
MAX_BACKEND_NAME = 32


def state_to_pb(state: VolumeState) -> int:
    return _STATE_TO_PB[state]


def state_from_pb(value: int, field: str = "state") -> VolumeState:
    state = _STATE_FROM_PB.get(value)
    if state is None:
        raise Invalid.at(field, f"{value} is not a volume state")
    return state


# ---- the public resource ----


def spec_from_pb(msg: pb.VolumeSpec, prefix: str = "spec.") -> VolumeSpec:
    """A user's VolumeSpec; Invalid names each bad field (`spec.size_bytes`)."""
    if not msg.name:
        raise Invalid.at(f"{prefix}name", "is required")
    try:
        return VolumeSpec(
            name=msg.name,
            size_bytes=msg.size_bytes,
            class_name=msg.class_name,
            pool=msg.pool,
            backend=msg.backend,
        )
    except ValidationError as err:
        raise invalid_from(err, prefix) from None


def spec_to_pb(spec: VolumeSpec) -> pb.VolumeSpec:
    return pb.VolumeSpec(
        name=spec.name,
        size_bytes=spec.size_bytes,
        class_name=spec.class_name,
        pool=spec.pool,
        backend=spec.backend,
    )


def volume_to_pb(v: Volume) -> pb.Volume:
    return pb.Volume(
        spec=spec_to_pb(v.spec),
        state=_STATE_TO_PB[v.state],
        node=v.node,
        backend=v.backend,
        pool=v.pool,
        attached_to=v.attached_to,
        message=v.message,
        workload=v.workload,
        ordinal=v.ordinal,
        created_by=v.created_by,
        create_time=timestamp_fields(v.created_at),
        update_time=timestamp_fields(v.updated_at),
        etag=v.etag,
    )


def volume_from_pb(msg: pb.Volume) -> Volume:
    """What the controller answered (the CLI's side): trusted, but still typed."""
    return Volume(
        spec=VolumeSpec.model_construct(
            name=msg.spec.name,
            size_bytes=msg.spec.size_bytes,
            class_name=msg.spec.class_name,
            pool=msg.spec.pool,
            backend=msg.spec.backend,
        ),
        state=_STATE_FROM_PB.get(msg.state, VolumeState.PENDING),
        node=msg.node,
        backend=msg.backend,
        pool=msg.pool,
        attached_to=list(msg.attached_to),
        message=msg.message,
        workload=msg.workload,
        ordinal=msg.ordinal,
        created_by=msg.created_by,
        created_at=seconds_from_pb(msg.create_time) or 0.0,
        updated_at=seconds_from_pb(msg.update_time) or 0.0,
        etag=msg.etag,
    )


# ---- the agent protocol ----


def report_from_pb(msg: apb.VolumeStatus) -> VolumeReport:
    """Agent input, checked before it touches any state: a valid volume name, a known state
    and backend, a size in bounds, a bounded list of instance names; a long message is cut."""
    try:
        name = check_name(msg.name, "volume status: name")
    except ValueError as err:
        raise Invalid(str(err)) from None
    what = f"volume status {quote(name)}"
    state = _STATE_FROM_PB.get(msg.state)
    if state is None:
        raise Invalid(f"{what}: state {msg.state} is not a volume state")
    # A backend the node was asked for and does not have comes back in a FAILED report: only
    # its length is bounded here; the controller records only backends it knows.
    if len(msg.backend) > MAX_BACKEND_NAME:
        raise Invalid(f"{what}: backend: at most {MAX_BACKEND_NAME} characters")
    if not 0 <= msg.size_bytes <= MAX_VOLUME_BYTES:
        raise Invalid(f"{what}: size_bytes {msg.size_bytes} is out of bounds")
    if len(msg.attached_to) > MAX_ATTACHED:
        raise Invalid(f"{what}: attached_to: at most {MAX_ATTACHED} instances")
    for i, inst in enumerate(msg.attached_to):
        if not inst or len(inst) > MAX_INSTANCE_NAME:
            raise Invalid(
                f"{what}: attached_to[{i}]: an instance name of 1-{MAX_INSTANCE_NAME} characters"
            )
    return VolumeReport.model_construct(
        name=name,
        state=state,
        size_bytes=msg.size_bytes,
        backend=msg.backend,
        message=msg.message[:MAX_VOLUME_MESSAGE],
        attached_to=list(msg.attached_to),
    )


def reports_from_pb(msgs: Iterable[apb.VolumeStatus], what: str) -> list[VolumeReport]:
    """A node's whole list (Register.volumes, NodeSync.volumes): bounded, each checked."""
    out = []
    for i, msg in enumerate(msgs):
        if i >= MAX_NODE_VOLUMES:
            raise Invalid(f"{what}: at most {MAX_NODE_VOLUMES} volumes")
        out.append(report_from_pb(msg))
    return out


def report_to_pb(r: VolumeReport) -> apb.VolumeStatus:
    """What an agent sends of one of its volumes."""
    return apb.VolumeStatus(
        name=r.name,
        state=_STATE_TO_PB[r.state],
        size_bytes=r.size_bytes,
        backend=r.backend,
        message=r.message,
        attached_to=r.attached_to,
    )


def attachment_from_pb(msg: apb.VolumeAttachment) -> VolumeAttachment:
    return VolumeAttachment(
        name=msg.name,
        size_bytes=msg.size_bytes,
        backend=msg.backend,
        node=msg.node,
        pool=msg.pool,
        mount_path=msg.mount_path,
        read_only=msg.read_only,
        env_name=msg.env_name,
    )


def attachment_to_pb(a: VolumeAttachment) -> apb.VolumeAttachment:
    return apb.VolumeAttachment(
        name=a.name,
        size_bytes=a.size_bytes,
        backend=a.backend,
        node=a.node,
        pool=a.pool,
        mount_path=a.mount_path,
        read_only=a.read_only,
        env_name=a.env_name,
    )


# A bound on what an agent may list (duplicates are harmless: the set is kept).
MAX_BACKENDS = 8


def volume_offer(info: apb.NodeInfo) -> tuple[str, frozenset[str], int]:
    """What a registering node offers for volumes (its pool, backends, volume space), checked
    like any input from outside: an agent names only backends this version knows."""
    try:
        pool = check_name(info.pool, "register: node.pool") if info.pool else DEFAULT_POOL
    except ValueError as err:
        raise Invalid(str(err)) from None
    if len(info.volume_backends) > MAX_BACKENDS:
        raise Invalid(f"register: node.volume_backends: at most {MAX_BACKENDS}")
    for i, b in enumerate(info.volume_backends):
        if b not in VOLUME_BACKENDS:
            raise Invalid(
                f"register: node.volume_backends[{i}]: {b[:32]!r} is not one of"
                f" {', '.join(VOLUME_BACKENDS)}"
            )
    if info.volume_capacity_bytes < 0:
        raise Invalid("register: node.volume_capacity_bytes must not be negative")
    return pool, frozenset(info.volume_backends), info.volume_capacity_bytes
