"""`kind: class` documents of a manifest: a COMPUTE class (`name`, `cpu`, `memory`, `kinds`) or,
with `type: volume`, a VOLUME class (`min_size`, `max_size`, `backends`, `immediate`)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from orka.cli.units import parse_cpu, parse_memory
from orka.errors import Invalid
from orka.models import Class, WorkloadKind
from orka.rpc.convert import invalid_from

_COMPUTE_KEYS = {"kind", "name", "type", "cpu", "memory", "kinds"}
_VOLUME_KEYS = {"kind", "name", "type", "min_size", "max_size", "backends", "immediate"}


def class_from_mapping(doc: dict[str, Any], where: str) -> Class:
    """`kind: class` with `name`, `cpu`, `memory` (and `kinds: [process, vm]`), or with
    `type: volume` and `min_size`, `max_size` (`64Mi`), `backends`, `immediate`."""
    from orka.cli.manifest import _normalise_keys  # one key rule for every document

    raw_type = doc.get("type", "compute")
    shape = raw_type.strip().lower() if isinstance(raw_type, str) else raw_type
    if shape not in ("compute", "volume"):
        raise Invalid(f"{where}: type: {raw_type!r} is not one of compute, volume")
    allowed = _COMPUTE_KEYS if shape == "compute" else _VOLUME_KEYS
    data = _normalise_keys(doc, allowed, where)
    if "name" not in data:
        raise Invalid(f"{where}: name: is required")
    body: dict[str, Any] = {"name": data["name"]}
    if shape == "compute":
        resources: dict[str, int] = {}
        if "cpu" in data:
            resources["cpu_millis"] = parse_cpu(data["cpu"], f"{where}: cpu")
        if "memory" in data:
            resources["memory_bytes"] = parse_memory(data["memory"], f"{where}: memory")
        body["compute"] = {"resources": resources, "kinds": _kinds(data.get("kinds"), where)}
    else:
        volume: dict[str, Any] = {}
        for key in ("min_size", "max_size"):
            if key in data:
                volume[f"{key}_bytes"] = parse_memory(data[key], f"{where}: {key}")
        if "backends" in data:
            backends = data["backends"]
            if isinstance(backends, str):
                backends = [b.strip() for b in backends.split(",") if b.strip()]
            volume["backends"] = backends
        if "immediate" in data:
            if not isinstance(data["immediate"], bool):
                raise Invalid(f"{where}: immediate: must be true or false")
            volume["immediate"] = data["immediate"]
        body["volume"] = volume
    try:
        return Class.model_validate(body)
    except ValidationError as err:
        raise Invalid(f"{where}: {invalid_from(err).message}") from None


def _kinds(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    names = ", ".join(k.value.lower() for k in WorkloadKind)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or item.strip().upper() not in WorkloadKind.__members__:
            raise Invalid(f"{where}: kinds: {item!r} is not one of {names}")
        out.append(item.strip().upper())
    return out
