"""Classes and pools between protobuf and the models (beside orka.rpc.convert)."""

from __future__ import annotations

from pydantic import ValidationError

from orka.api import controller_pb2 as pb
from orka.errors import Invalid
from orka.models import Class, ClassCount, Pool, WorkloadKind
from orka.rpc.convert import (
    invalid_from,
    resources_from_pb,
    resources_to_pb,
    seconds_from_pb,
    timestamp_fields,
)

_KINDS_TO_PB = {k: pb.WorkloadSpec.Kind.Value(k.value) for k in WorkloadKind}
_KINDS_FROM_PB = {v: k for k, v in _KINDS_TO_PB.items()}
# Bounds on what one class may list: every kind at most once, every backend at most once.
MAX_CLASS_KINDS = len(WorkloadKind)


def class_from_pb(msg: pb.Class, prefix: str = "spec.") -> Class:
    """A user's class, checked: Invalid naming each bad field under `prefix`."""
    data: dict[str, object] = {"name": msg.name}
    shape = msg.WhichOneof("shape")
    if shape == "compute":
        c = msg.compute
        kinds = []
        for i, number in enumerate(c.kinds):
            kind = _KINDS_FROM_PB.get(number)
            if kind is None:
                raise Invalid.at(
                    f"{prefix}compute.kinds[{i}]",
                    f"unknown kind {number}; use PROCESS, CONTAINER or VM",
                )
            if kind in kinds:
                raise Invalid.at(f"{prefix}compute.kinds[{i}]", f"{kind.value} is given twice")
            kinds.append(kind)
        data["compute"] = {
            "resources": {
                "cpu_millis": c.resources.cpu_millis,
                "memory_bytes": c.resources.memory_bytes,
            },
            "kinds": kinds,
        }
    elif shape == "volume":
        v = msg.volume
        backends = list(v.backends)
        for i, b in enumerate(backends):
            if b in backends[:i]:
                raise Invalid.at(f"{prefix}volume.backends[{i}]", f"{b!r} is given twice")
        data["volume"] = {
            "min_size_bytes": v.min_size_bytes,
            "max_size_bytes": v.max_size_bytes,
            "backends": backends,
            "immediate": v.immediate,
        }
    else:
        raise Invalid.at(f"{prefix}compute", "give exactly one of compute and volume")
    try:
        return Class.model_validate(data)
    except ValidationError as err:
        raise invalid_from(err, prefix) from None


def class_to_pb(c: Class) -> pb.Class:
    msg = pb.Class(
        name=c.name,
        create_time=timestamp_fields(c.created_at),
        update_time=timestamp_fields(c.updated_at),
        etag=c.etag,
    )
    if c.compute is not None:
        msg.compute.CopyFrom(
            pb.Class.Compute(
                resources=resources_to_pb(c.compute.resources),
                kinds=[_KINDS_TO_PB[k] for k in c.compute.kinds],
            )
        )
    if c.volume is not None:
        v = c.volume
        msg.volume.CopyFrom(
            pb.Class.Volume(
                min_size_bytes=v.min_size_bytes,
                max_size_bytes=v.max_size_bytes,
                backends=v.backends,
                immediate=v.immediate,
            )
        )
    return msg


def pool_to_pb(p: Pool) -> pb.Pool:
    return pb.Pool(
        name=p.name,
        node_count=p.node_count,
        ready_node_count=p.ready_node_count,
        capacity=resources_to_pb(p.capacity),
        allocatable=resources_to_pb(p.allocatable),
        allocated=resources_to_pb(p.allocated),
        available_classes=[
            pb.Pool.ClassCount(class_name=c.class_name, count=c.count) for c in p.available_classes
        ],
        volume_capacity_bytes=p.volume_capacity_bytes,
        volume_backends=p.volume_backends,
    )


def class_model_from_pb(msg: pb.Class) -> Class:
    """A class as the controller answered it (the CLI's view), times and etag included."""
    c = class_from_pb(msg, prefix="")
    return c.model_copy(
        update={
            "created_at": seconds_from_pb(msg.create_time) or c.created_at,
            "updated_at": seconds_from_pb(msg.update_time) or c.updated_at,
            "etag": msg.etag,
        }
    )


def pool_from_pb(msg: pb.Pool) -> Pool:
    return Pool(
        name=msg.name,
        node_count=msg.node_count,
        ready_node_count=msg.ready_node_count,
        capacity=resources_from_pb(msg.capacity),
        allocatable=resources_from_pb(msg.allocatable),
        allocated=resources_from_pb(msg.allocated),
        available_classes=[
            ClassCount(class_name=c.class_name, count=c.count) for c in msg.available_classes
        ],
        volume_capacity_bytes=msg.volume_capacity_bytes,
        volume_backends=list(msg.volume_backends),
    )
