"""Workload manifests: YAML documents in a flat form or a `kind: Workload` wrapper."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orka.cli import volumes as volume_docs
from orka.cli.class_manifest import class_from_mapping
from orka.cli.units import parse_cpu, parse_duration, parse_memory
from orka.errors import Invalid
from orka.models import (
    MAX_STOP_GRACE_SECONDS,
    Class,
    ExecCheck,
    HealthCheck,
    HttpCheck,
    PortSpec,
    TcpCheck,
    UpdateStrategy,
    VmSpec,
    VolumeSpec,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc.convert import invalid_from

_CAMEL_RE = re.compile(r"(?<=[a-z0-9])([A-Z])")
_WRAPPER_KEYS = frozenset({"apiVersion", "kind", "metadata", "spec"})
_RESOURCE_KEYS = {
    "cpu": "cpu",
    "cpu_millis": "cpu_millis",
    "memory": "memory",
    "memory_bytes": "memory_bytes",
}
# Maps whose values users write unquoted (`port: 8080`, `ssd: true`) but the API holds as strings.
_STRING_MAPS = ("env", "secret_env", "secret_env_files", "node_selector")
# A manifest names fields as the API does: the grace period is a duration (`30s`, `1m`), as
# the API's `stop_grace_period` and grpcurl show it, not the model's float seconds.
_SPEC_KEYS = (set(WorkloadSpec.model_fields) - {"stop_grace_seconds", "class_name"}) | {
    "stop_grace_period",
    "class",
}
# What parse_manifests returns: workloads, and the classes they may name.
Manifest = WorkloadSpec | Class | VolumeSpec
_KIND_OF: dict[type, str] = {Class: "class", VolumeSpec: "volume"}


def snake(key: str) -> str:
    return _CAMEL_RE.sub(r"_\1", key).replace("-", "_").lower()


def _enum_name(value: str) -> str:
    """`OnFailure`, `on-failure`, `on_failure` and `ON_FAILURE` all mean ON_FAILURE."""
    return snake(value.strip()).upper()


def _scalar_str(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value


def _normalise_keys(doc: dict[Any, Any], allowed: set[str], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw in doc:
        if not isinstance(raw, str):
            raise Invalid(f"{where}: key {raw!r} is not a string")
        key = snake(raw)
        if key not in allowed:
            known = ", ".join(sorted(allowed))
            raise Invalid(f"{where}: unknown key {raw!r} (known keys: {known})")
        if key in out:
            raise Invalid(f"{where}: key {raw!r} is given twice (as camelCase and snake_case)")
        out[key] = doc[raw]
    return out


def _resources(value: Any, where: str) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Invalid(f"{where}: resources must be a mapping like {{cpu: 500m, memory: 256Mi}}")
    data = _normalise_keys(value, set(_RESOURCE_KEYS), f"{where}: resources")
    out: dict[str, int] = {}
    if "cpu" in data and "cpu_millis" in data:
        raise Invalid(f"{where}: resources: give cpu or cpu_millis, not both")
    if "memory" in data and "memory_bytes" in data:
        raise Invalid(f"{where}: resources: give memory or memory_bytes, not both")
    if "cpu" in data:
        out["cpu_millis"] = parse_cpu(data["cpu"], f"{where}: resources.cpu")
    if "cpu_millis" in data:
        out["cpu_millis"] = parse_cpu(f"{data['cpu_millis']}m", f"{where}: resources.cpu_millis")
    if "memory" in data:
        out["memory_bytes"] = parse_memory(data["memory"], f"{where}: resources.memory")
    if "memory_bytes" in data:
        out["memory_bytes"] = parse_memory(data["memory_bytes"], f"{where}: resources.memory_bytes")
    return out


def _port(value: Any, where: str) -> Any:
    """`{name: http, port: 8080, hostPort: 0, protocol: TCP}`: keys in either case, the
    protocol in any case; anything else is left for the model to name."""
    if not isinstance(value, dict):
        return value
    data = _normalise_keys(value, set(PortSpec.model_fields), where)
    if isinstance(data.get("protocol"), str):
        data["protocol"] = data["protocol"].strip().lower()
    return data


_CHECK_SPANS = ("interval", "timeout", "initial_delay")


def _health_check(value: Any, where: str) -> Any:
    """`{http: {port: web, path: /healthz}, interval: 5s, failureThreshold: 3}`: keys in either
    case; spans as durations (`5s`, `500ms`) or bare seconds; the rest is for the model."""
    if not isinstance(value, dict):
        return value
    data = _normalise_keys(value, set(HealthCheck.model_fields), where)
    for key in _CHECK_SPANS:
        span = data.get(key)
        if isinstance(span, str):
            data[key] = parse_duration(span, f"{where}.{key}")
    for key, model in (("exec", ExecCheck), ("tcp", TcpCheck), ("http", HttpCheck)):
        if isinstance(data.get(key), dict):
            data[key] = _normalise_keys(data[key], set(model.model_fields), f"{where}.{key}")
    exec_ = data.get("exec")
    if isinstance(exec_, dict) and isinstance(exec_.get("command"), str):
        exec_["command"] = shlex.split(exec_["command"])
    return data


def _kind(value: Any, where: str) -> str:
    names = ", ".join(k.value.lower() for k in WorkloadKind)
    if not isinstance(value, str) or value.strip().upper() not in WorkloadKind.__members__:
        raise Invalid(f"{where}: kind: {value!r} is not one of {names}")
    return value.strip().upper()


def _percent(value: Any, replicas: Any, up: bool, where: str) -> Any:
    """`25%` of the replicas, rounded up for max_surge and down for max_unavailable, as
    Kubernetes does; anything else is left for the model to name."""
    if not isinstance(value, str) or not value.strip().endswith("%"):
        return value
    text = value.strip()[:-1]
    if not text.isdigit() or int(text) > 100:
        raise Invalid(f"{where}: {value!r} is not a percentage from 0% to 100%")
    count = replicas if isinstance(replicas, int) and not isinstance(replicas, bool) else 1
    share = int(text) * count
    return -(-share // 100) if up else share // 100


def _seconds(value: Any, where: str) -> Any:
    """Whole seconds as a number, or a duration (`30s`, `10m`)."""
    if isinstance(value, str):
        seconds = parse_duration(value, where)
        if seconds != int(seconds):
            raise Invalid(f"{where}: must be whole seconds, got {value!r}")
        return int(seconds)
    return value


def _update(value: Any, replicas: Any, where: str) -> Any:
    """The `update:` mapping: keys in either case; max_surge / max_unavailable as counts or
    percentages of the replicas; min_ready_seconds / progress_deadline_seconds as seconds or
    durations."""
    if not isinstance(value, dict):
        return value
    data = _normalise_keys(value, set(UpdateStrategy.model_fields), f"{where}: update")
    for key, up in (("max_surge", True), ("max_unavailable", False)):
        if key in data:
            data[key] = _percent(data[key], replicas, up, f"{where}: update.{key}")
    if (
        data.get("max_surge") == 0
        and data.get("max_unavailable") == 0
        and any(isinstance(value.get(k), str) for k in value)
    ):
        data["max_surge"] = 1  # both percentages rounded to 0: Kubernetes keeps one moving
    for key in ("min_ready_seconds", "progress_deadline_seconds"):
        if key in data:
            data[key] = _seconds(data[key], f"{where}: update.{key}")
    return data


def spec_from_mapping(doc: dict[Any, Any], where: str) -> WorkloadSpec:
    """One flat workload mapping (camelCase or snake_case keys) to a validated spec."""
    data = _normalise_keys(doc, _SPEC_KEYS, where)
    if "kind" not in data:
        raise Invalid(f"{where}: kind: is required (process, container or vm)")
    if "class" in data:
        # `class:` in a manifest, as users write it; the API's field is class_name.
        data["class_name"] = data.pop("class")
    data["kind"] = _kind(data["kind"], where)
    if "resources" in data:
        data["resources"] = _resources(data["resources"], where)
    if isinstance(data.get("restart_policy"), str):
        data["restart_policy"] = _enum_name(data["restart_policy"])
    if isinstance(data.get("command"), str):
        # A single string is a shell-style command line, not one argv element with spaces.
        data["command"] = shlex.split(data["command"])
    for key in _STRING_MAPS:
        if isinstance(data.get(key), dict):
            data[key] = {str(k): _scalar_str(v) for k, v in data[key].items()}
    if "stop_grace_period" in data:
        grace = parse_duration(data.pop("stop_grace_period"), f"{where}: stop_grace_period")
        if grace > MAX_STOP_GRACE_SECONDS:
            raise Invalid(f"{where}: stop_grace_period: must be at most {MAX_STOP_GRACE_SECONDS}s")
        data["stop_grace_seconds"] = grace
    if isinstance(data.get("on_node_lost"), str):
        data["on_node_lost"] = _enum_name(data["on_node_lost"])
    if "max_disconnect" in data:
        data["max_disconnect"] = parse_duration(data["max_disconnect"], f"{where}: max_disconnect")
    if isinstance(data.get("vm"), dict):
        data["vm"] = _normalise_keys(data["vm"], set(VmSpec.model_fields), f"{where}: vm")
    if isinstance(data.get("network"), str):
        data["network"] = data["network"].strip().lower()
    if isinstance(data.get("ports"), list):
        data["ports"] = [_port(p, f"{where}: ports[{i}]") for i, p in enumerate(data["ports"])]
    if "update" in data:
        data["update"] = _update(data["update"], data.get("replicas", 1), where)
    if "health_check" in data:
        data["health_check"] = _health_check(data["health_check"], f"{where}: health_check")
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as err:
        raise Invalid(f"{where}: {invalid_from(err).message}") from None


def _unwrap(doc: dict[Any, Any], where: str) -> dict[Any, Any]:
    """`kind: Workload` + metadata.name + spec -> the flat form."""
    for key in doc:
        if key not in _WRAPPER_KEYS:
            raise Invalid(
                f"{where}: unknown key {key!r} in a kind: Workload document "
                "(known keys: apiVersion, kind, metadata, spec)"
            )
    spec = doc.get("spec") or {}
    if not isinstance(spec, dict):
        raise Invalid(f"{where}: spec must be a mapping")
    meta = doc.get("metadata") or {}
    if not isinstance(meta, dict):
        raise Invalid(f"{where}: metadata must be a mapping")
    for key in meta:
        if key != "name":
            raise Invalid(f"{where}: unknown key {key!r} in metadata (known keys: name)")
    flat = dict(spec)
    if "name" in meta:
        if "name" in flat and flat["name"] != meta["name"]:
            raise Invalid(
                f"{where}: metadata.name {meta['name']!r} and spec.name {flat['name']!r} differ"
            )
        flat["name"] = meta["name"]
    return flat


def parse_manifests(text: str, source: str = "<stdin>") -> list[Manifest]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise Invalid(f"{source}: not valid YAML: {e}") from None
    specs: list[Manifest] = []
    seen: dict[str, str] = {}
    for index, doc in enumerate(docs, start=1):
        where = f"{source}: document {index}"
        if doc is None:
            continue  # a stray `---` at the start or end
        if not isinstance(doc, dict):
            raise Invalid(f"{where}: expected a mapping (a workload), got {type(doc).__name__}")
        kind = doc.get("kind")
        if isinstance(kind, str) and kind.strip().lower() == "workload":
            doc = _unwrap(doc, where)
        spec: Manifest
        if isinstance(kind, str) and kind.strip().lower() == "class":
            spec = class_from_mapping(doc, where)
        elif volume_docs.is_volume(doc):
            spec = volume_docs.spec_from_mapping(doc, where)
        else:
            spec = spec_from_mapping(doc, where)
        what = f"{_KIND_OF.get(type(spec), 'workload')} {spec.name!r}"
        if what in seen:
            raise Invalid(f"{where}: {what} is already defined in {seen[what]}")
        seen[what] = where
        specs.append(spec)
    if not specs:
        raise Invalid(f"{source}: no workloads found")
    return specs


def load_manifests(path: str) -> list[Manifest]:
    if path == "-":
        return parse_manifests(sys.stdin.read(), "<stdin>")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise Invalid(f"-f: cannot read {path}: {e.strerror or e}") from None
    return parse_manifests(text, path)
