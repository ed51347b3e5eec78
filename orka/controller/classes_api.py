"""The class and pool RPCs of the controller API (Create/Get/List/Update/DeleteClass,
ListPools), and how a workload's `class_name` is resolved into its resources. ControllerApi
binds the RPCs as its methods, so they share its boundary table (roles, leader only)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from orka.api import controller_pb2 as pb
from orka.controller import paging
from orka.controller.pools import compute_pools
from orka.controller.repo import Change, Repo
from orka.errors import AlreadyExists, Conflict, Invalid, NotFound, ResourceExhausted
from orka.etags import check_etag, new_workload_etag
from orka.models import Class, Resources, WorkloadSpec
from orka.rpc.convert_classes import class_from_pb, class_to_pb, pool_to_pb
from orka.security.identity import Identity
from orka.validation import quote

if TYPE_CHECKING:
    from orka.controller.api import ControllerApi

# Past this many classes a create is refused: every ListPools weighs each against each node.
MAX_CLASSES = 1000


def resolve_class(repo: Repo, spec: WorkloadSpec) -> WorkloadSpec:
    """The spec as stored: a COMPUTE class's cpu and memory fill the resources the spec leaves
    at 0. Done when the workload is written, so changing the class later never resizes what
    runs (applying the workload again takes the new shape). Invalid naming spec.class_name when
    the class is missing, a VOLUME class, or not for the workload's kind."""
    name = spec.class_name
    if not name:
        return spec
    c = repo.classes.get(name)
    if c is None:
        raise Invalid.at("spec.class_name", f"class {quote(name)} does not exist")
    if c.compute is None:
        raise Invalid.at(
            "spec.class_name", f"class {quote(name)} is a VOLUME class, not a COMPUTE class"
        )
    kinds = c.compute.kinds
    if kinds and spec.kind not in kinds:
        allowed = ", ".join(k.value for k in kinds)
        raise Invalid.at(
            "spec.class_name",
            f"class {quote(name)} is for {allowed} workloads, not {spec.kind.value}",
        )
    given, shape = spec.resources, c.compute.resources
    resources = Resources(
        cpu_millis=given.cpu_millis or shape.cpu_millis,
        memory_bytes=given.memory_bytes or shape.memory_bytes,
    )
    if resources == given:
        return spec
    return spec.model_copy(update={"resources": resources})


def _class(api: ControllerApi, name: str) -> Class:
    from orka.controller.api import _name  # one name check for every RPC

    c = api.repo.classes.get(_name(name))
    if c is None:
        raise NotFound(f"class {quote(name)} not found")
    return c


def _class_pb(api: ControllerApi, c: Class) -> pb.Class:
    msg = class_to_pb(c)
    msg.revision = api.repo.revision_of("classes", c.name)
    return msg


async def create_class(
    api: ControllerApi, request: pb.CreateClassRequest, who: Identity
) -> pb.Class:
    c = class_from_pb(request.spec)

    def plan() -> list[Change]:
        if c.name in api.repo.classes:
            raise AlreadyExists(f"class {quote(c.name)} already exists")
        if len(api.repo.classes) >= MAX_CLASSES:
            raise ResourceExhausted(
                f"quota max_classes: the cluster already holds {MAX_CLASSES} classes, its limit"
            )
        return [Change("classes", c.name, c, create=True)]

    await api.repo.mutate(plan)
    return _class_pb(api, api.repo.classes.get(c.name, c))


async def get_class(api: ControllerApi, request: pb.GetClassRequest, who: Identity) -> pb.Class:
    return _class_pb(api, _class(api, request.name))


async def list_classes(
    api: ControllerApi, request: pb.ListClassesRequest, who: Identity
) -> pb.ListClassesResponse:
    size = paging.page_size(request.page_size)
    filters = paging.fingerprint("classes")
    start = paging.decode_token(request.page_token, filters, (str,))
    classes = api.repo.classes

    def pick(key: paging.Key) -> pb.Class | None:
        c = classes.get(key[0])
        return _class_pb(api, c) if c is not None else None

    keys = paging.after(api.repo.order["classes"], start)
    page, last = paging.take_page(keys, size, pick, pb.Class.ByteSize)
    return pb.ListClassesResponse(
        classes=page,
        next_page_token=paging.encode_token(last, filters) if last else "",
        revision=api.repo.revision,
    )


async def update_class(
    api: ControllerApi, request: pb.UpdateClassRequest, who: Identity
) -> pb.Class:
    c = class_from_pb(request.spec)

    def plan() -> list[Change]:
        old = api.repo.classes.get(c.name)
        if old is None:
            raise NotFound(f"class {quote(c.name)} not found")
        check_etag(request.etag, old.etag, f"class {quote(c.name)}")
        # Workloads and volumes name a class for what it is: one kind never turns into the other.
        if (old.compute is None) != (c.compute is None):
            was, now = ("compute", "volume") if old.compute is not None else ("volume", "compute")
            raise Invalid.at(f"spec.{now}", f"class {quote(c.name)} is a {was} class")
        if old.compute == c.compute and old.volume == c.volume:
            return []
        new = c.model_copy(
            update={
                "created_at": old.created_at,
                "updated_at": time.time(),
                "etag": new_workload_etag(),
            }
        )
        return [Change("classes", c.name, new)]

    await api.repo.mutate(plan)
    return _class_pb(api, api.repo.classes[c.name])


def users_of(api: ControllerApi, name: str) -> list[str]:
    """The workloads and volumes that name the class, as "workload web", "volume data-1"."""
    users = [
        f"workload {w.name}"
        for w in api.repo.workloads.values()
        if w.spec.class_name == name
        or (w.spec.volume_template is not None and w.spec.volume_template.class_name == name)
    ]
    users += [f"volume {v.name}" for v in api.repo.volumes.values() if v.spec.class_name == name]
    return sorted(users)


async def delete_class(
    api: ControllerApi, request: pb.DeleteClassRequest, who: Identity
) -> pb.Class:
    gone = _class(api, request.name)

    def plan() -> list[Change]:
        c = api.repo.classes.get(gone.name)
        if c is None:
            raise NotFound(f"class {quote(gone.name)} not found")
        check_etag(request.etag, c.etag, f"class {quote(c.name)}")
        users = users_of(api, c.name)
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise Conflict(f"class {quote(c.name)} is used by {shown}; delete or change them first")
        return [Change("classes", c.name, None)]

    msg = _class_pb(api, gone)
    await api.repo.mutate(plan)
    return msg


async def list_pools(
    api: ControllerApi, request: pb.ListPoolsRequest, who: Identity
) -> pb.ListPoolsResponse:
    size = paging.page_size(request.page_size)
    filters = paging.fingerprint("pools")
    start = paging.decode_token(request.page_token, filters, (str,))
    pools = [
        p
        for p in compute_pools(api.repo.nodes.values(), api.repo.classes.values())
        if start is None or (p.name,) > start
    ]
    page = [pool_to_pb(p) for p in pools[:size]]
    more = len(pools) > size
    return pb.ListPoolsResponse(
        pools=page,
        next_page_token=paging.encode_token((page[-1].name,), filters) if more else "",
        revision=api.repo.revision,
    )
