"""The Volume RPCs: CreateVolume, GetVolume, ListVolumes, DeleteVolume.

A volume is created PENDING with no node; placement binds it to a node when an instance first
uses it (or the controller does at once, for a class with `immediate`: orka/controller/
volumes.py). Deleting one is a request to its node, acknowledged before the record goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from orka.api import controller_pb2 as pb
from orka.controller import paging
from orka.controller import volumes as vols
from orka.controller.repo import Change
from orka.errors import AlreadyExists, FieldViolation, Invalid, NotFound
from orka.etags import check_etag
from orka.models import NodeState, Volume, VolumeSpec, check_name
from orka.rpc import convert_volumes
from orka.security.identity import Identity
from orka.validation import quote

if TYPE_CHECKING:
    from orka.controller.api import ControllerApi


F = TypeVar("F", bound=Callable[..., Any])


def rpc(name: str) -> Callable[[F], F]:
    """Name the handler after its RPC: the audit log records a call by its handler's name."""

    def named(fn: F) -> F:
        fn.__name__ = fn.__qualname__ = name
        return fn

    return named


def _name(value: str, field: str = "name") -> str:
    try:
        return check_name(value, field)
    except ValueError as err:
        text = str(err)
        raise Invalid(
            text, fields=[FieldViolation(field, text.removeprefix(f"{field} "))]
        ) from None


def _volume_pb(api: ControllerApi, v: Volume) -> pb.Volume:
    msg = convert_volumes.volume_to_pb(v)
    msg.revision = api.repo.revision_of("volumes", v.name)
    return msg


def check_spec(api: ControllerApi, spec: VolumeSpec) -> None:
    """What the spec asks against the classes and nodes there are: Invalid naming the field."""
    if spec.class_name:
        cls = api.repo.classes.get(spec.class_name)
        if cls is None:
            raise Invalid.at("spec.class_name", f"class {quote(spec.class_name)} not found")
        shape = cls.volume
        if shape is None:
            raise Invalid.at(
                "spec.class_name",
                f"class {quote(spec.class_name)} is a COMPUTE class, not a VOLUME class",
            )
        size = spec.size_bytes
        if shape.min_size_bytes and size < shape.min_size_bytes:
            raise Invalid.at(
                "spec.size_bytes",
                f"{vols.size_text(size)} is below the minimum of class"
                f" {quote(cls.name)} ({vols.size_text(shape.min_size_bytes)})",
            )
        if shape.max_size_bytes and size > shape.max_size_bytes:
            raise Invalid.at(
                "spec.size_bytes",
                f"{vols.size_text(size)} is above the maximum of class"
                f" {quote(cls.name)} ({vols.size_text(shape.max_size_bytes)})",
            )
        if spec.backend and shape.backends and spec.backend not in shape.backends:
            raise Invalid.at(
                "spec.backend",
                f"{quote(spec.backend)} is not allowed by class {quote(cls.name)}"
                f" ({', '.join(shape.backends)})",
            )
    # Nodes that hold volumes at all (of the pool asked for): a volume none could hold would
    # wait forever. With no such node known yet, nothing to compare against.
    sizes = [
        n.volume_capacity_bytes
        for n in api.repo.nodes.values()
        if n.state is not NodeState.LEFT
        and n.volume_capacity_bytes > 0
        and (not spec.pool or n.pool == spec.pool)
    ]
    if sizes and spec.size_bytes > max(sizes):
        where = f"node of pool {quote(spec.pool)}" if spec.pool else "node"
        raise Invalid.at(
            "spec.size_bytes",
            f"{vols.size_text(spec.size_bytes)} is larger than any {where} can hold"
            f" (largest: {vols.size_text(max(sizes))})",
        )


@rpc("CreateVolume")
async def create_volume(
    api: ControllerApi, request: pb.CreateVolumeRequest, who: Identity
) -> pb.Volume:
    spec = convert_volumes.spec_from_pb(request.spec)
    volume = Volume(spec=spec, created_by=str(who))

    def plan() -> list[Change]:
        if spec.name in api.repo.volumes:
            raise AlreadyExists(f"volume {quote(spec.name)} already exists")
        check_spec(api, spec)
        return [Change("volumes", spec.name, volume, create=True)]

    await api.repo.mutate(plan)
    if api.volume_keeper is not None:
        api.volume_keeper.kick()
    return _volume_pb(api, api.repo.volumes.get(spec.name, volume))


@rpc("GetVolume")
async def get_volume(api: ControllerApi, request: pb.GetVolumeRequest, who: Identity) -> pb.Volume:
    v = api.repo.volumes.get(_name(request.name))
    if v is None:
        raise NotFound(f"volume {quote(request.name)} not found")
    return _volume_pb(api, v)


@rpc("ListVolumes")
async def list_volumes(
    api: ControllerApi, request: pb.ListVolumesRequest, who: Identity
) -> pb.ListVolumesResponse:
    if request.node:
        _name(request.node, "node")
    if request.workload:
        _name(request.workload, "workload")
    size = paging.page_size(request.page_size)
    filters = paging.fingerprint("volumes", request.node, request.workload)
    start = paging.decode_token(request.page_token, filters, (str,))
    table = api.repo.volumes
    node, workload = request.node, request.workload

    def pick(key: paging.Key) -> pb.Volume | None:
        v = table.get(key[0])
        if v is None or (node and v.node != node) or (workload and v.workload != workload):
            return None
        return _volume_pb(api, v)

    keys = paging.after(api.repo.order["volumes"], start)
    page, last = paging.take_page(keys, size, pick, pb.Volume.ByteSize)
    return pb.ListVolumesResponse(
        volumes=page,
        next_page_token=paging.encode_token(last, filters) if last else "",
        revision=api.repo.revision,
    )


@rpc("DeleteVolume")
async def delete_volume(
    api: ControllerApi, request: pb.DeleteVolumeRequest, who: Identity
) -> pb.Volume:
    name = _name(request.name)
    answer: list[pb.Volume] = []

    def plan() -> list[Change]:
        v = api.repo.volumes.get(name)
        if v is None:
            raise NotFound(f"volume {quote(name)} not found")
        check_etag(request.etag, v.etag, f"volume {quote(name)}")
        vols.check_deletable(api.repo, v)
        change = vols.delete_change(v, time.time())
        # What the caller gets: the volume as DELETING, or as it was when it is gone at once.
        answer.append(_volume_pb(api, change.value if change.value is not None else v))
        if change.value is v:
            return []
        return [change]

    await api.repo.mutate(plan)
    if api.volume_keeper is not None:
        api.volume_keeper.kick()
    current = api.repo.volumes.get(name)
    return _volume_pb(api, current) if current is not None else answer[-1]
