"""Agent-side volume messages <-> domain models (orka.models VolumeAttachment, VolumeReport)."""

from __future__ import annotations

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.models import VolumeAttachment, VolumeReport, VolumeState

_STATE_TO_PB = {s: pb.Volume.State.Value(s.value) for s in VolumeState}
_STATE_FROM_PB = {n: s for s, n in _STATE_TO_PB.items()}


def volume_state_to_pb(state: VolumeState) -> int:
    return _STATE_TO_PB[state]


def volume_state_from_pb(value: int) -> VolumeState | None:
    return _STATE_FROM_PB.get(value)


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


def report_to_pb(r: VolumeReport) -> apb.VolumeStatus:
    return apb.VolumeStatus(
        name=r.name,
        state=_STATE_TO_PB[r.state],
        size_bytes=r.size_bytes,
        backend=r.backend,
        message=r.message,
        attached_to=r.attached_to,
    )


def report_from_pb(msg: apb.VolumeStatus) -> VolumeReport | None:
    """None for a state the agent may not report (unset or unknown)."""
    state = _STATE_FROM_PB.get(msg.state)
    if state is None:
        return None
    return VolumeReport(
        name=msg.name,
        state=state,
        size_bytes=msg.size_bytes,
        backend=msg.backend,
        message=msg.message,
        attached_to=list(msg.attached_to),
    )
