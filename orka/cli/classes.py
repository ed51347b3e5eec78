"""Classes and pools in the CLI: `orka apply` of a class, `orka get classes|pools`, `orka get
class X`, `orka delete class X` (`kind: class` documents are read by orka.cli.class_manifest)."""

from __future__ import annotations

from collections.abc import Sequence

from orka.api import controller_pb2 as pb
from orka.cli import output
from orka.cli.client import AdminClient
from orka.cli.units import format_cpu, format_memory
from orka.errors import AlreadyExists, NotFound
from orka.models import Class, Pool
from orka.rpc.convert_classes import class_model_from_pb, class_to_pb, pool_from_pb

# ---- the API ----


async def apply_class(client: AdminClient, c: Class) -> str:
    """Create if absent, else update with the etag just read; the verb to print."""
    try:
        current = class_model_from_pb(
            await client._call("GetClass", pb.GetClassRequest(name=c.name))
        )
    except NotFound:
        try:
            await client._call("CreateClass", pb.CreateClassRequest(spec=class_to_pb(c)))
        except AlreadyExists:
            raise AlreadyExists(
                f"class/{c.name} was created by someone else meanwhile; nothing was applied"
            ) from None
        return "created"
    if current.compute == c.compute and current.volume == c.volume:
        return "unchanged"
    req = pb.UpdateClassRequest(spec=class_to_pb(c), etag=current.etag)
    await client._call("UpdateClass", req)
    return "configured"


async def get_class(client: AdminClient, name: str) -> Class:
    return class_model_from_pb(await client._call("GetClass", pb.GetClassRequest(name=name)))


async def list_classes(client: AdminClient) -> list[Class]:
    items = await client._list("ListClasses", pb.ListClassesRequest(), "classes")
    return [class_model_from_pb(m) for m in items]  # type: ignore[arg-type]


async def list_pools(client: AdminClient) -> list[Pool]:
    items = await client._list("ListPools", pb.ListPoolsRequest(), "pools")
    return [pool_from_pb(m) for m in items]  # type: ignore[arg-type]


async def delete_class(client: AdminClient, name: str, etag: str = "") -> None:
    await client._call("DeleteClass", pb.DeleteClassRequest(name=name, etag=etag))


async def get_text(client: AdminClient, kind: str, name: str | None, fmt: str) -> str:
    """What `orka get classes|pools [NAME]` prints."""
    if kind == "classes":
        classes = [await get_class(client, name)] if name else await list_classes(client)
        if fmt != "table":
            return output.dump(classes[0] if name else classes, fmt)
        return classes_table(classes)
    pools = await list_pools(client)
    if name:
        pools = [p for p in pools if p.name == name]
        if not pools:
            raise NotFound(f"pool {name!r} not found (no node joined it)")
        if fmt != "table":
            return output.dump(pools[0], fmt)
    return output.dump(pools, fmt) if fmt != "table" else pools_table(pools)


# ---- tables ----

CLASS_HEADERS = ("NAME", "TYPE", "CPU", "MEMORY", "KINDS", "SIZE", "BACKENDS", "AGE")
POOL_HEADERS = ("POOL", "NODES", "READY", "CPU", "MEMORY", "CLASSES")


def _size_range(low: int, high: int) -> str:
    if not low and not high:
        return "any"
    return f"{format_memory(low) if low else '0'}-{format_memory(high) if high else 'any'}"


def class_row(c: Class, now: float | None = None) -> tuple[object, ...]:
    age = output.age(c.created_at, now)
    if c.compute is not None:
        r = c.compute.resources
        kinds = ",".join(k.value.lower() for k in c.compute.kinds) or "any"
        cpu = format_cpu(r.cpu_millis) if r.cpu_millis else output.NONE
        mem = format_memory(r.memory_bytes) if r.memory_bytes else output.NONE
        return (c.name, "compute", cpu, mem, kinds, "-", "-", age)
    v = c.volume
    assert v is not None  # exactly one shape
    backends = ",".join(v.backends) or "any"
    size = _size_range(v.min_size_bytes, v.max_size_bytes)
    kind = "volume (immediate)" if v.immediate else "volume"
    return (c.name, kind, "-", "-", "-", size, backends, age)


def classes_table(items: Sequence[Class], now: float | None = None) -> str:
    return output.table(CLASS_HEADERS, [class_row(c, now) for c in items])


def pool_row(p: Pool) -> tuple[object, ...]:
    classes = " ".join(f"{c.class_name}={c.count}" for c in p.available_classes)
    return (
        p.name,
        p.node_count,
        p.ready_node_count,
        f"{format_cpu(p.allocated.cpu_millis)}/{format_cpu(p.allocatable.cpu_millis)}",
        f"{format_memory(p.allocated.memory_bytes)}/{format_memory(p.allocatable.memory_bytes)}",
        classes or output.NONE,
    )


def pools_table(items: Sequence[Pool]) -> str:
    return output.table(POOL_HEADERS, [pool_row(p) for p in items])
