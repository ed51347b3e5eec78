"""Volumes in the CLI: `kind: volume` manifests, `orka get|describe|delete volume`, and how
volumes are shown (table, text, json, yaml)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from orka.cli import output
from orka.cli.client import AdminClient
from orka.cli.units import format_memory, parse_memory
from orka.errors import AlreadyExists, Invalid, NotFound
from orka.models import Volume, VolumeSpec
from orka.rpc.convert import invalid_from

# What a `kind: volume` document may say (camelCase or snake_case), and the spec field of each.
_KEYS = {
    "kind": "",
    "name": "name",
    "size": "size_bytes",
    "class": "class_name",
    "class_name": "class_name",
    "pool": "pool",
    "backend": "backend",
}


_CAMEL_RE = re.compile(r"(?<=[a-z0-9])([A-Z])")


def snake(key: str) -> str:
    return _CAMEL_RE.sub(r"_\1", key).replace("-", "_").lower()


def is_volume(doc: dict[Any, Any]) -> bool:
    kind = doc.get("kind")
    return isinstance(kind, str) and kind.strip().lower() == "volume"


def spec_from_mapping(doc: dict[Any, Any], where: str) -> VolumeSpec:
    """One `kind: volume` document: name, size (`64Mi`, `1Gi` or bytes), and optionally class,
    pool and backend."""
    data: dict[str, Any] = {}
    for raw, value in doc.items():
        key = snake(raw) if isinstance(raw, str) else raw
        if key not in _KEYS:
            known = ", ".join(k for k in _KEYS if k != "class_name")
            raise Invalid(f"{where}: unknown key {raw!r} in a kind: volume (known keys: {known})")
        if _KEYS[key]:
            if _KEYS[key] in data:
                raise Invalid(f"{where}: key {raw!r} is given twice")
            data[_KEYS[key]] = value
    if "size_bytes" not in data:
        raise Invalid(f"{where}: size: is required (e.g. 64Mi, 1Gi)")
    data["size_bytes"] = parse_memory(data["size_bytes"], f"{where}: size")
    for key in ("name", "class_name", "pool", "backend"):
        if key in data and not isinstance(data[key], str):
            raise Invalid(f"{where}: {key.removesuffix('_name')}: must be a string")
    try:
        return VolumeSpec.model_validate(data)
    except ValidationError as err:
        message = invalid_from(err).message.replace("size_bytes", "size")
        raise Invalid(f"{where}: {message.replace('class_name', 'class')}") from None


async def apply_volume(client: AdminClient, spec: VolumeSpec) -> str:
    """Create if absent; a volume is never changed in place (its data is on one node)."""
    try:
        current = await client.get_volume(spec.name)
    except NotFound:
        try:
            await client.create_volume(spec)
        except AlreadyExists:
            raise AlreadyExists(
                f"volume/{spec.name} was created by someone else meanwhile"
            ) from None
        return "created"
    if current.spec == spec:
        return "unchanged"
    raise Invalid(
        f"volume/{spec.name} exists with another spec ({spec_text(current.spec)}); a volume"
        f" cannot be changed: delete it (orka delete volume {spec.name}) and apply again"
    )


def spec_text(s: VolumeSpec) -> str:
    parts = [f"size {format_memory(s.size_bytes)}"]
    parts += [f"{k} {v}" for k, v in (("class", s.class_name), ("pool", s.pool)) if v]
    if s.backend:
        parts.append(f"backend {s.backend}")
    return ", ".join(parts)


# ---- rendering ----

HEADERS = ("NAME", "SIZE", "STATE", "NODE", "BACKEND", "ATTACHED")


def row(v: Volume) -> tuple[object, ...]:
    return (
        v.name,
        format_memory(v.spec.size_bytes),
        v.state.value,
        v.node or output.NONE,
        v.backend or v.spec.backend or output.NONE,
        ",".join(v.attached_to) or output.NONE,
    )


def table(items: Sequence[Volume]) -> str:
    return output.table(HEADERS, [row(v) for v in items])


def describe(v: Volume, now: float | None = None) -> str:
    s = v.spec
    pairs: list[tuple[str, object]] = [
        ("Name", v.name),
        ("Size", format_memory(s.size_bytes)),
        ("State", v.state.value),
        ("Class", s.class_name or output.NONE),
        ("Pool", v.pool or s.pool or output.NONE),
        ("Node", v.node or "<none> (placed when an instance first uses it)"),
        ("Backend", v.backend or s.backend or output.NONE),
        ("Attached to", ", ".join(v.attached_to) or output.NONE),
    ]
    if v.workload:
        pairs.append(("Template of", f"workload {v.workload}, replica {v.ordinal}"))
    if v.message:
        pairs.append(("Message", v.message))
    pairs += [
        ("Created", output.timestamp(v.created_at, now)),
        ("Created by", v.created_by or output.NONE),
        ("Etag", v.etag),
    ]
    text = output.fields(pairs)
    if v.node:
        # Local storage: say plainly what a lost node means for it.
        text += f"\nData lives on node {v.node}'s disk only: if that node is lost, so is the data."
    return text


async def get(client: AdminClient, name: str, fmt: str, node: str = "", workload: str = "") -> str:
    if name:
        v = await client.get_volume(name)
        return output.dump(v, fmt) if fmt != "table" else table([v])
    items = sorted(await client.list_volumes(node=node, workload=workload), key=lambda v: v.name)
    return output.dump(items, fmt) if fmt != "table" else table(items)
