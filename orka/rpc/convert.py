"""The one place where protobuf messages become domain models and back."""

from __future__ import annotations

import functools
import ipaddress
import math
import re
from collections.abc import Iterable, Mapping
from typing import Protocol

from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import code_pb2, status_pb2
from pydantic import ValidationError

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import MORE_VIOLATIONS, FieldViolation, Invalid
from orka.etags import node_etag
from orka.models import (
    DEFAULT_POOL,
    MAX_DISCONNECT_SECONDS,
    MAX_PORT_NAME,
    MAX_PORTS,
    MAX_STOP_GRACE_SECONDS,
    REDACTED,
    Endpoint,
    HealthCheck,
    HealthState,
    Instance,
    InstancePhase,
    InstanceReport,
    NetworkMode,
    Node,
    NodeState,
    OnNodeLost,
    PortBinding,
    PortProtocol,
    PortSpec,
    Resources,
    RestartPolicy,
    Revision,
    Rollout,
    RolloutState,
    UpdateStrategy,
    Workload,
    WorkloadSpec,
    WorkloadStatus,
    check_name,
)
from orka.validation import MAX_SPEC_BYTES, quote

# The errors named in one message: a spec with 1,000 bad arguments gets a short answer.
MAX_REPORTED_ERRORS = 5


def field_path(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as the field is written: `command[2]`, `env['KEY']`,
    `vm.kernel`. A map key is user input, so it is quoted and cut."""
    out = ""
    for i, part in enumerate(loc):
        if part == "[key]":
            out += " (key)"
        elif isinstance(part, int):
            out += f"[{part}]"
        elif i > 0 and isinstance(loc[i - 1], str) and loc[i - 1] in _MAPPING_FIELDS:
            out += f"[{quote(part)}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_MAPPING_FIELDS = frozenset({"env", "node_selector", "labels"})
_NAMED_FIELD = re.compile(r"^((?:\[\d+\]|[a-z_]+)(?:\[\d+\])?(?:\.[a-z_]+)*): ")


def invalid_from(err: ValidationError, prefix: str = "") -> Invalid:
    """Turn pydantic's report into one message that names each offending field, and one
    field violation per field (the path from the error's `loc`)."""
    parts = []
    fields = []
    errors = err.errors(include_input=False, include_url=False)
    for e in errors[:MAX_REPORTED_ERRORS]:
        loc = field_path(tuple(e["loc"]))
        msg = str(e["msg"]).removeprefix("Value error, ")
        # A validator that checks a whole list or spec names the element it means at the start
        # of its message ("[1].name: ...", "ports[0].port: ..."): that is the field.
        named = _NAMED_FIELD.match(msg)
        if named and (loc or not named.group(1).startswith("[")):
            dot = "." if loc and not named.group(1).startswith("[") else ""
            loc, msg = f"{loc}{dot}{named.group(1)}", msg[named.end() :]
        field = f"{prefix}{loc}" if loc else prefix.rstrip(".")
        parts.append(f"{field}: {msg}" if field else msg)
        if field:
            fields.append(FieldViolation(field, msg))
    more: dict[str, str] = {}
    if len(errors) > MAX_REPORTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_REPORTED_ERRORS} more")
        more[MORE_VIOLATIONS] = str(len(errors) - MAX_REPORTED_ERRORS)
    return Invalid("; ".join(parts), fields=fields, metadata=more)


def timestamp_fields(seconds: float | None) -> dict[str, int] | None:
    """A Unix time in float seconds (how the models hold it) as a Timestamp's fields, for a
    message constructor (several times faster than building a Timestamp and copying it in);
    None (or 0, which the models use for "never") leaves the field unset.

    To the microsecond: a float Unix time holds no finer (a double carries ~16 digits, ten of
    them whole seconds), and grpcurl then shows `12:00:00.123456Z`, not float noise in nine
    digits. Whole seconds and the fraction apart, so that no digit is lost on the way."""
    if not seconds:
        return None
    # A float holds Unix times in microseconds exactly enough (2**53 us is year 2255); divmod
    # floors, so times before 1970 still get nanos in [0, 1e9) as Timestamp requires.
    whole, micros = divmod(round(seconds * 1e6), 1_000_000)
    return {"seconds": whole, "nanos": micros * 1000}


def set_timestamp(ts: Timestamp, seconds: float) -> None:
    """The same into an existing Timestamp field."""
    fields = timestamp_fields(seconds)
    if fields is None:
        ts.Clear()
    else:
        ts.seconds, ts.nanos = fields["seconds"], fields["nanos"]


def seconds_from_pb(ts: Timestamp) -> float | None:
    """A Timestamp as float seconds; unset (or the epoch itself, "never" to the models) is None."""
    whole, nanos = ts.seconds, ts.nanos
    if not whole and not nanos:
        return None
    return whole + nanos / 1e9


def duration_fields(seconds: float) -> dict[str, int]:
    """A span of float seconds (>= 0) as a Duration's fields, for a message constructor."""
    whole = math.floor(seconds)
    nanos = round((seconds - whole) * 1e9)
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, nanos - 1_000_000_000
    return {"seconds": whole, "nanos": nanos}


def duration_from_pb(d: Duration, field: str) -> float:
    """A Duration a client sent, as float seconds; one whose parts disagree is refused."""
    if (
        not -999_999_999 <= d.nanos <= 999_999_999
        or (d.seconds < 0 < d.nanos)
        or (d.nanos < 0 < d.seconds)
    ):
        raise Invalid(
            f"{field}: not a valid Duration (seconds {d.seconds}, nanos {d.nanos}: nanos must"
            " be within ±999,999,999 and have the sign of seconds)",
            field=field,
        )
    return d.seconds + d.nanos / 1e9


def resources_from_pb(msg: pb.Resources) -> Resources:
    return Resources.model_construct(cpu_millis=msg.cpu_millis, memory_bytes=msg.memory_bytes)


def resources_to_pb(r: Resources) -> pb.Resources:
    return pb.Resources(cpu_millis=r.cpu_millis, memory_bytes=r.memory_bytes)


def spec_from_pb(msg: pb.WorkloadSpec) -> WorkloadSpec:
    # Agents parse the same spec for every offer and start of a workload's instances, and the
    # model is frozen, so one validated model per distinct message serves them all.
    check_spec_size(msg)
    data = msg.SerializeToString(deterministic=True)
    if len(data) > MAX_CACHED_SPEC_BYTES:
        # Not kept: the cache holds each key and model, and 1,024 specs of up to 1 MiB each
        # grew the controller by ~1.7 MB per update of a big workload.
        return _parse_spec(msg)
    return _spec_from_bytes(data)


# Specs up to this size are remembered (most are a few hundred bytes): at most ~32 MiB held.
MAX_CACHED_SPEC_BYTES = 16 << 10


def check_spec_size(msg: pb.WorkloadSpec) -> None:
    """A spec travels whole in every List, watch event, offer and start: over the limit it is
    refused, naming its largest field (before any field is parsed)."""
    size = msg.ByteSize()
    if size <= MAX_SPEC_BYTES:
        return
    fields = [(f.name, _field_bytes(msg, f.name)) for f, _ in msg.ListFields()]
    name, biggest = max(fields, key=lambda f: f[1])
    raise Invalid.at(
        f"spec.{name}",
        f"is {biggest} bytes serialized, making the spec {size} bytes,"
        f" over the limit of {MAX_SPEC_BYTES} bytes",
    )


def _field_bytes(msg: pb.WorkloadSpec, name: str) -> int:
    one = pb.WorkloadSpec()
    value = getattr(msg, name)
    if isinstance(value, Message):
        getattr(one, name).CopyFrom(value)
    elif hasattr(value, "items"):
        getattr(one, name).update(value)
    elif hasattr(value, "extend"):
        getattr(one, name).extend(value)
    else:
        setattr(one, name, value)
    return one.ByteSize()


@functools.lru_cache(maxsize=1024)
def _spec_from_bytes(data: bytes) -> WorkloadSpec:
    return _parse_spec(pb.WorkloadSpec.FromString(data))


def _parse_spec(msg: pb.WorkloadSpec) -> WorkloadSpec:
    if msg.kind == pb.WorkloadSpec.KIND_UNSPECIFIED:
        raise Invalid.at("spec.kind", "is required (PROCESS, CONTAINER or VM)")
    if msg.kind not in (pb.WorkloadSpec.PROCESS, pb.WorkloadSpec.CONTAINER, pb.WorkloadSpec.VM):
        raise Invalid.at("spec.kind", f"unknown kind {msg.kind}; use PROCESS, CONTAINER or VM")
    if msg.restart_policy == pb.WorkloadSpec.RESTART_POLICY_UNSPECIFIED:
        policy = RestartPolicy.ALWAYS.value
    elif msg.restart_policy in pb.WorkloadSpec.RestartPolicy.values():
        policy = pb.WorkloadSpec.RestartPolicy.Name(msg.restart_policy)
    else:
        raise Invalid.at(
            "spec.restart_policy",
            f"unknown policy {msg.restart_policy}; use ALWAYS, ON_FAILURE or NEVER",
        )
    data: dict[str, object] = {
        "name": msg.name,
        "kind": pb.WorkloadSpec.Kind.Name(msg.kind),
        "image": msg.image,
        "command": list(msg.command),
        "env": dict(msg.env),
        "replicas": msg.replicas,
        "resources": {
            "cpu_millis": msg.resources.cpu_millis,
            "memory_bytes": msg.resources.memory_bytes,
        },
        "node_selector": dict(msg.node_selector),
        "restart_policy": policy,
        "working_dir": msg.working_dir,
        "max_per_node": msg.max_per_node,
        "user": msg.user,
        "group": msg.group,
        "secret_env": dict(msg.secret_env),
        "secret_env_files": dict(msg.secret_env_files),
    }
    if msg.ports:
        data["ports"] = [_port_spec(p, f"spec.ports[{i}]") for i, p in enumerate(msg.ports)]
    if msg.network:
        if msg.network not in _NETWORK_FROM_PB:
            raise Invalid.at(
                "spec.network", f"unknown network mode {msg.network}; use HOST or BRIDGE"
            )
        data["network"] = _NETWORK_FROM_PB[msg.network]
    if msg.HasField("vm"):
        data["vm"] = {"kernel": msg.vm.kernel, "initrd": msg.vm.initrd, "cmdline": msg.vm.cmdline}
    if msg.HasField("update"):
        data["update"] = update_from_pb(msg.update)
    if msg.HasField("stop_grace_period"):
        grace = duration_from_pb(msg.stop_grace_period, "spec.stop_grace_period")
        if not 0 <= grace <= MAX_STOP_GRACE_SECONDS:
            raise Invalid.at(
                "spec.stop_grace_period",
                f"must be between 0s and {MAX_STOP_GRACE_SECONDS:g}s, got {grace:g}s",
            )
        data["stop_grace_seconds"] = grace
    if msg.HasField("health_check"):
        data["health_check"] = _health_check(msg.health_check)
    if msg.on_node_lost:
        if msg.on_node_lost not in _ON_NODE_LOST_FROM_PB:
            raise Invalid.at(
                "spec.on_node_lost",
                f"unknown policy {msg.on_node_lost}; use ON_NODE_LOST_REPLACE or ON_NODE_LOST_WAIT",
            )
        data["on_node_lost"] = _ON_NODE_LOST_FROM_PB[msg.on_node_lost]
    if msg.HasField("max_disconnect"):
        wait = duration_from_pb(msg.max_disconnect, "spec.max_disconnect")
        if not 0 < wait <= MAX_DISCONNECT_SECONDS:
            raise Invalid.at(
                "spec.max_disconnect",
                f"must be more than 0s and at most {MAX_DISCONNECT_SECONDS}s, got {wait:g}s",
            )
        data["max_disconnect"] = wait
    if msg.class_name:
        data["class_name"] = msg.class_name
    if msg.pool:
        data["pool"] = msg.pool
    if msg.volumes:
        data["volumes"] = [
            {"volume": m.volume, "mount_path": m.mount_path, "read_only": m.read_only}
            for m in msg.volumes
        ]
    if msg.HasField("volume_template"):
        t = msg.volume_template
        data["volume_template"] = {
            "name": t.name,
            "size_bytes": t.size_bytes,
            "class_name": t.class_name,
            "mount_path": t.mount_path,
            "read_only": t.read_only,
        }
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as err:
        raise invalid_from(err, "spec.") from None


def update_from_pb(msg: pb.UpdateStrategy) -> dict[str, object]:
    """The update strategy's fields; both bounds 0 is refused here with a violation for each
    (the model's own check names one), so a client can mark both fields."""
    data: dict[str, object] = {
        "max_unavailable": msg.max_unavailable,
        "min_ready_seconds": msg.min_ready_seconds,
        "auto_rollback": msg.auto_rollback,
        "canary": msg.canary,
    }
    if msg.HasField("max_surge"):
        data["max_surge"] = msg.max_surge
    if msg.HasField("progress_deadline_seconds"):
        data["progress_deadline_seconds"] = msg.progress_deadline_seconds
    if msg.max_unavailable == 0 and data.get("max_surge", 1) == 0:
        why = "max_unavailable and max_surge are both 0: no instance could ever be replaced"
        raise Invalid(
            f"spec.update: {why}",
            fields=[
                FieldViolation("spec.update.max_unavailable", why),
                FieldViolation("spec.update.max_surge", why),
            ],
        )
    return data


def update_to_pb(u: UpdateStrategy) -> pb.UpdateStrategy:
    return pb.UpdateStrategy(
        max_unavailable=u.max_unavailable,
        max_surge=u.max_surge,
        min_ready_seconds=u.min_ready_seconds,
        progress_deadline_seconds=u.progress_deadline_seconds,
        auto_rollback=u.auto_rollback,
        canary=u.canary,
    )


_ROLLOUT_STATE_TO_PB = {state: pb.RolloutStatus.State.Value(state.value) for state in RolloutState}


def rollout_to_pb(r: Rollout) -> pb.RolloutStatus:
    return pb.RolloutStatus(
        state=_ROLLOUT_STATE_TO_PB[r.state],  # type: ignore[arg-type]
        revision=r.revision,
        stable_revision=r.stable,
        rollback_of=r.rollback_of,
        message=r.message,
        deadline_time=timestamp_fields(r.deadline),
        promoted=r.promoted,
    )


def rollout_from_pb(msg: pb.RolloutStatus) -> Rollout:
    state = RolloutState.COMPLETE
    if msg.state:
        state = RolloutState(pb.RolloutStatus.State.Name(msg.state))
    return Rollout(
        state=state,
        revision=msg.revision,
        stable=msg.stable_revision,
        rollback_of=msg.rollback_of,
        message=msg.message,
        deadline=seconds_from_pb(msg.deadline_time) or 0.0,
        promoted=msg.promoted,
    )


def revision_to_pb(r: Revision) -> pb.WorkloadRevision:
    """For users: secret values redacted, as in every spec a user reads."""
    return pb.WorkloadRevision(
        revision=r.revision,
        spec=spec_to_pb(r.spec, redact=True) if r.spec is not None else None,
        create_time=timestamp_fields(r.created_at),
        created_by=r.created_by,
        cause=r.cause,
    )


def revision_from_pb(msg: pb.WorkloadRevision) -> Revision:
    return Revision(
        revision=msg.revision,
        spec=spec_from_pb(msg.spec),
        created_at=seconds_from_pb(msg.create_time) or 0.0,
        created_by=msg.created_by,
        cause=msg.cause,
    )


def _health_check(msg: pb.HealthCheck) -> dict[str, object]:
    """The check's fields for the model, which names what is wrong in them; unset numbers keep
    the model's defaults."""
    where = "spec.health_check"
    data: dict[str, object] = {}
    mode = msg.WhichOneof("check")
    if mode == "exec":
        data["exec"] = {"command": list(msg.exec.command)}
    elif mode == "tcp":
        data["tcp"] = {"port": msg.tcp.port}
    elif mode == "http":
        http: dict[str, object] = {"port": msg.http.port}
        if msg.http.path:
            http["path"] = msg.http.path
        if msg.http.status_min:
            http["status_min"] = msg.http.status_min
        if msg.http.status_max:
            http["status_max"] = msg.http.status_max
        data["http"] = http
    for name in ("interval", "timeout", "initial_delay"):
        if msg.HasField(name):
            data[name] = duration_from_pb(getattr(msg, name), f"{where}.{name}")
    for name in ("failure_threshold", "success_threshold"):
        if getattr(msg, name):
            data[name] = getattr(msg, name)
    return data


def health_check_to_pb(check: HealthCheck) -> pb.HealthCheck:
    msg = pb.HealthCheck(
        interval=duration_fields(check.interval),
        timeout=duration_fields(check.timeout),
        initial_delay=duration_fields(check.initial_delay),
        failure_threshold=check.failure_threshold,
        success_threshold=check.success_threshold,
    )
    if check.exec is not None:
        msg.exec.command.extend(check.exec.command)
    elif check.tcp is not None:
        msg.tcp.port = check.tcp.port
    elif check.http is not None:
        msg.http.CopyFrom(
            pb.HealthCheck.Http(
                port=check.http.port,
                path=check.http.path,
                status_min=check.http.status_min,
                status_max=check.http.status_max,
            )
        )
    return msg


_PROTOCOL_FROM_PB = {
    pb.PortSpec.PROTOCOL_UNSPECIFIED: PortProtocol.TCP,
    pb.PortSpec.TCP: PortProtocol.TCP,
    pb.PortSpec.UDP: PortProtocol.UDP,
}
_PROTOCOL_TO_PB = {PortProtocol.TCP: pb.PortSpec.TCP, PortProtocol.UDP: pb.PortSpec.UDP}


_NETWORK_FROM_PB = {
    pb.WorkloadSpec.HOST: NetworkMode.HOST,
    pb.WorkloadSpec.BRIDGE: NetworkMode.BRIDGE,
}
_NETWORK_TO_PB = {mode: number for number, mode in _NETWORK_FROM_PB.items()}


def protocol_to_pb(protocol: PortProtocol) -> int:
    return _PROTOCOL_TO_PB[protocol]


def _protocol(value: int, field: str) -> PortProtocol:
    protocol = _PROTOCOL_FROM_PB.get(value)  # type: ignore[call-overload]
    if protocol is None:
        raise Invalid.at(field, f"unknown protocol {value}; use TCP or UDP")
    return protocol


def _port_spec(msg: pb.PortSpec, field: str) -> dict[str, object]:
    return {
        "name": msg.name,
        "port": msg.port if msg.HasField("port") else None,
        "host_port": msg.host_port,
        "protocol": _protocol(msg.protocol, f"{field}.protocol"),
    }


def port_spec_to_pb(p: PortSpec) -> pb.PortSpec:
    msg = pb.PortSpec(name=p.name, host_port=p.host_port, protocol=_PROTOCOL_TO_PB[p.protocol])
    if p.port is not None:
        msg.port = p.port
    return msg


def binding_to_pb(b: PortBinding) -> pb.PortBinding:
    return pb.PortBinding(
        name=b.name, port=b.port, host_port=b.host_port, protocol=_PROTOCOL_TO_PB[b.protocol]
    )


def binding_from_pb(msg: pb.PortBinding) -> PortBinding:
    return PortBinding(
        name=msg.name,
        port=msg.port,
        host_port=msg.host_port,
        protocol=_PROTOCOL_FROM_PB.get(msg.protocol, PortProtocol.TCP),  # type: ignore[call-overload]
    )


_ON_NODE_LOST_FROM_PB = {
    pb.WorkloadSpec.ON_NODE_LOST_REPLACE: OnNodeLost.REPLACE,
    pb.WorkloadSpec.ON_NODE_LOST_WAIT: OnNodeLost.WAIT,
}
_ON_NODE_LOST_TO_PB = {policy: number for number, policy in _ON_NODE_LOST_FROM_PB.items()}


def spec_to_pb(spec: WorkloadSpec, redact: bool = False) -> pb.WorkloadSpec:
    """`redact` for anything a user reads (Get, List, Watch): secret values become REDACTED.
    Only the spec sent towards the agents that start instances carries them in clear."""
    secrets = dict.fromkeys(spec.secret_env, REDACTED) if redact else spec.secret_env
    msg = pb.WorkloadSpec(
        name=spec.name,
        kind=pb.WorkloadSpec.Kind.Value(spec.kind.value),
        image=spec.image,
        command=spec.command,
        env=spec.env,
        replicas=spec.replicas,
        resources=resources_to_pb(spec.resources),
        node_selector=spec.node_selector,
        restart_policy=pb.WorkloadSpec.RestartPolicy.Value(spec.restart_policy.value),
        working_dir=spec.working_dir,
        max_per_node=spec.max_per_node,
        stop_grace_period=duration_fields(spec.stop_grace_seconds),
        user=spec.user,
        group=spec.group,
        secret_env=secrets,
        secret_env_files=spec.secret_env_files,
        ports=[port_spec_to_pb(p) for p in spec.ports],
        network=_NETWORK_TO_PB[spec.network] if spec.network else None,
        update=update_to_pb(spec.update),
        class_name=spec.class_name,
        pool=spec.pool,
        volumes=[
            pb.VolumeMount(volume=m.volume, mount_path=m.mount_path, read_only=m.read_only)
            for m in spec.volumes
        ],
    )
    if spec.volume_template is not None:
        t = spec.volume_template
        msg.volume_template.CopyFrom(
            pb.VolumeTemplate(
                name=t.name,
                size_bytes=t.size_bytes,
                class_name=t.class_name,
                mount_path=t.mount_path,
                read_only=t.read_only,
            )
        )
    if spec.health_check is not None:
        msg.health_check.CopyFrom(health_check_to_pb(spec.health_check))
    if spec.on_node_lost is not OnNodeLost.REPLACE:
        # REPLACE, the default, stays unset: a spec as written before the field reads the same.
        msg.on_node_lost = _ON_NODE_LOST_TO_PB[spec.on_node_lost]
    if spec.max_disconnect:
        msg.max_disconnect.CopyFrom(Duration(**duration_fields(spec.max_disconnect)))
    if spec.vm is not None:
        msg.vm.CopyFrom(
            pb.VmSpec(kernel=spec.vm.kernel, initrd=spec.vm.initrd, cmdline=spec.vm.cmdline)
        )
    return msg


def workload_to_pb(w: Workload) -> pb.Workload:
    """For users (Get, List, Watch, and what Create, Update and Delete answer): redacted."""
    s = w.status
    return pb.Workload(
        spec=spec_to_pb(w.spec, redact=True),
        status=pb.WorkloadStatus(
            desired=s.desired,
            placed=s.placed,
            running=s.running,
            healthy=s.healthy,
            unschedulable_reasons=s.unschedulable_reasons,
            unschedulable_unresolvable=s.unschedulable_unresolvable,
            message=s.message,
            updated=s.updated,
            ready=s.ready,
        ),
        rollout=rollout_to_pb(w.rollout),
        generation=w.generation,
        deleting=w.deleting,
        create_time=timestamp_fields(w.created_at),
        update_time=timestamp_fields(w.updated_at),
        created_by=w.created_by,
        updated_by=w.updated_by,
        etag=w.etag,
    )


def workload_from_pb(msg: pb.Workload) -> Workload:
    s = msg.status
    return Workload(
        spec=spec_from_pb(msg.spec),
        status=WorkloadStatus(
            desired=s.desired,
            placed=s.placed,
            running=s.running,
            healthy=s.healthy,
            unschedulable_reasons=list(s.unschedulable_reasons),
            unschedulable_unresolvable=s.unschedulable_unresolvable,
            message=s.message,
            updated=s.updated,
            ready=s.ready,
        ),
        rollout=rollout_from_pb(msg.rollout),
        generation=msg.generation,
        deleting=msg.deleting,
        created_at=seconds_from_pb(msg.create_time) or 0.0,
        updated_at=seconds_from_pb(msg.update_time) or 0.0,
        created_by=msg.created_by,
        updated_by=msg.updated_by,
        etag=msg.etag,
    )


_PHASE_TO_PB = {phase: pb.Instance.Phase.Value(phase.value) for phase in InstancePhase}


def phase_to_pb(phase: InstancePhase) -> int:
    return _PHASE_TO_PB[phase]


_PHASE_FROM_PB = {number: phase for phase, number in _PHASE_TO_PB.items()}
# What an agent may report: DISCONNECTED is the controller's word for an instance it cannot see.
_REPORTED_PHASE_FROM_PB = {
    number: phase
    for number, phase in _PHASE_FROM_PB.items()
    if phase is not InstancePhase.DISCONNECTED
}


_HEALTH_TO_PB = {health: pb.Instance.Health.Value(health.value) for health in HealthState}
_HEALTH_FROM_PB = {number: health for health, number in _HEALTH_TO_PB.items()}
_HEALTH_FROM_PB[pb.Instance.Health.HEALTH_UNSPECIFIED] = HealthState.UNKNOWN


def health_from_pb(value: int, field: str = "health") -> HealthState:
    health = _HEALTH_FROM_PB.get(value)
    if health is None:
        raise Invalid(f"{field}: unknown health {value}")
    return health


def phase_from_pb(value: int, field: str = "phase") -> InstancePhase:
    phase = _PHASE_FROM_PB.get(value)
    if phase is not None:
        return phase
    if value == pb.Instance.PHASE_UNSPECIFIED:
        raise Invalid.at(field, "is required")
    raise Invalid.at(field, f"unknown phase {value}")


def _reported_phase(value: int, field: str) -> InstancePhase:
    if value == pb.Instance.DISCONNECTED:
        raise Invalid.at(field, "DISCONNECTED is set by the controller, never reported")
    return phase_from_pb(value, field)


def instance_fields(i: Instance) -> dict[str, object]:
    """An instance as pb.Instance constructor arguments: what an event embeds without building
    the message twice (once alone, once copied into the event)."""
    fields: dict[str, object] = {
        "name": i.name,
        "workload": i.workload,
        "node": i.node,
        "phase": _PHASE_TO_PB[i.phase],
        "reason": i.reason,
        "message": i.message,
        "restarts": i.restarts,
        "generation": i.generation,
        "create_time": timestamp_fields(i.created_at),
        "update_time": timestamp_fields(i.updated_at),
        "schedule_time": timestamp_fields(i.scheduled_at),
        "start_time": timestamp_fields(i.started_at),
        "end_time": timestamp_fields(i.finished_at),
    }
    if i.exit_code is not None:
        fields["exit_code"] = i.exit_code
    if i.address:
        fields["address"] = i.address
    if i.host_ip:
        fields["host_ip"] = i.host_ip
    if i.ports:
        fields["ports"] = [binding_to_pb(b) for b in i.ports]
    fields["health"] = _HEALTH_TO_PB[i.health]
    if i.ordinal:
        fields["ordinal"] = i.ordinal
    if i.health_message:
        fields["health_message"] = i.health_message
    if i.health_changed_at is not None:
        fields["health_time"] = timestamp_fields(i.health_changed_at)
    if i.disconnected_at is not None:
        fields["disconnect_time"] = timestamp_fields(i.disconnected_at)
    return fields


def instance_to_pb(i: Instance) -> pb.Instance:
    return pb.Instance(**instance_fields(i))  # type: ignore[arg-type]


def instance_from_pb(msg: pb.Instance) -> Instance:
    return Instance(
        name=msg.name,
        workload=msg.workload,
        node=msg.node,
        phase=phase_from_pb(msg.phase),
        reason=msg.reason,
        message=msg.message,
        exit_code=msg.exit_code if msg.HasField("exit_code") else None,
        restarts=msg.restarts,
        generation=msg.generation,
        created_at=seconds_from_pb(msg.create_time) or 0.0,
        updated_at=seconds_from_pb(msg.update_time) or 0.0,
        scheduled_at=seconds_from_pb(msg.schedule_time),
        started_at=seconds_from_pb(msg.start_time),
        finished_at=seconds_from_pb(msg.end_time),
        address=msg.address,
        host_ip=msg.host_ip,
        ports=[binding_from_pb(b) for b in msg.ports],
        health=health_from_pb(msg.health),
        health_message=msg.health_message,
        health_changed_at=seconds_from_pb(msg.health_time),
        ordinal=msg.ordinal,
        disconnected_at=seconds_from_pb(msg.disconnect_time),
    )


def endpoint_from_pb(msg: pb.Endpoint) -> Endpoint:
    return Endpoint(
        instance=msg.instance,
        node=msg.node,
        address=msg.address,
        host_ip=msg.host_ip,
        ports=[binding_from_pb(b) for b in msg.ports],
    )


def node_to_pb(n: Node) -> pb.Node:
    msg = node_static_to_pb(
        n.name,
        n.capacity,
        n.allocatable,
        n.labels,
        n.drivers,
        pool=n.pool,
        volume_backends=n.volume_backends,
        volume_capacity_bytes=n.volume_capacity_bytes,
    )
    fill_node_status(
        msg,
        state=n.state,
        schedulable=n.schedulable,
        draining=n.draining,
        leaving=n.leaving,
        allocated_cpu_millis=n.allocated.cpu_millis,
        allocated_memory_bytes=n.allocated.memory_bytes,
        usage=n.usage,
        instance_count=n.instance_count,
        last_heartbeat=n.last_heartbeat,
        message=n.message,
    )
    return msg


# pb.Node is written by these two alone: node_to_pb for a Node model (the controller), and the
# scheduler's feed for its live records, which keeps each node's static part (what only
# registering changes) as one message and fills the rest in per update (feed.NodeMessages).


def node_static_to_pb(
    name: str,
    capacity: Resources,
    allocatable: Resources,
    labels: Mapping[str, str],
    drivers: Iterable[str],
    *,
    pool: str = DEFAULT_POOL,
    volume_backends: Iterable[str] = (),
    volume_capacity_bytes: int = 0,
) -> pb.Node:
    """A node's part that only registering changes."""
    return pb.Node(
        name=name,
        capacity=resources_to_pb(capacity),
        allocatable=resources_to_pb(allocatable),
        labels=labels,
        drivers=sorted(drivers),
        pool=pool,
        volume_backends=sorted(volume_backends),
        volume_capacity_bytes=volume_capacity_bytes,
    )


_NODE_STATES = {state: pb.Node.State.Value(state.value) for state in NodeState}
_NODE_STATES_FROM_PB = {number: state for state, number in _NODE_STATES.items()}


def fill_node_status(
    msg: pb.Node,
    *,
    state: NodeState,
    schedulable: bool,
    draining: bool,
    allocated_cpu_millis: int,
    allocated_memory_bytes: int,
    usage: Resources,
    instance_count: int,
    last_heartbeat: float,
    message: str,
    leaving: bool = False,
) -> None:
    """Write what changes with every heartbeat into `msg` (a node's static part)."""
    msg.state = _NODE_STATES[state]
    msg.schedulable = schedulable
    msg.draining = draining
    msg.leaving = leaving
    # Set even when zero: the sub-messages are present. Allocation comes as two numbers: the
    # scheduler keeps it so, and publishes every node at each usage report.
    allocated = msg.allocated
    allocated.cpu_millis = allocated_cpu_millis
    allocated.memory_bytes = allocated_memory_bytes
    msg_usage = msg.usage
    msg_usage.cpu_millis = usage.cpu_millis
    msg_usage.memory_bytes = usage.memory_bytes
    msg.instance_count = instance_count
    if last_heartbeat:
        set_timestamp(msg.last_heartbeat_time, last_heartbeat)
    msg.message = message
    # Of the fields users write, just set: the message is its own node record here.
    msg.etag = node_etag(msg)


def node_from_pb(msg: pb.Node) -> Node:
    state = NodeState.READY
    if msg.state != pb.Node.STATE_UNSPECIFIED:
        known = _NODE_STATES_FROM_PB.get(msg.state)
        if known is None:
            raise Invalid(f"node {quote(msg.name)}: unknown state {msg.state}", field="state")
        state = known
    return Node(
        name=msg.name,
        state=state,
        schedulable=msg.schedulable,
        draining=msg.draining,
        leaving=msg.leaving,
        capacity=resources_from_pb(msg.capacity),
        allocatable=resources_from_pb(msg.allocatable),
        allocated=resources_from_pb(msg.allocated),
        usage=resources_from_pb(msg.usage),
        labels=dict(msg.labels),
        drivers=list(msg.drivers),
        instance_count=msg.instance_count,
        last_heartbeat=seconds_from_pb(msg.last_heartbeat_time) or 0.0,
        message=msg.message,
        pool=msg.pool or DEFAULT_POOL,
        volume_backends=list(msg.volume_backends),
        volume_capacity_bytes=msg.volume_capacity_bytes,
    )


class StatusSource(Protocol):
    """What an instance status is made from: an InstanceReport (the scheduler's record of
    what an agent said) or the agent's own Supervised instance, read directly rather than
    through a model (an agent sends one per change)."""

    name: str
    workload: str
    phase: InstancePhase
    reason: str
    message: str
    exit_code: int | None
    restarts: int
    started_at: float | None
    finished_at: float | None
    address: str
    host_ip: str
    ports: list[PortBinding]
    health: HealthState
    health_message: str
    health_changed_at: float | None


def instance_status_to_pb(
    i: StatusSource, resources: Resources | None = None, generation: int = 0
) -> apb.InstanceStatus:
    msg = apb.InstanceStatus(
        name=i.name,
        workload=i.workload,
        phase=phase_to_pb(i.phase),
        reason=i.reason,
        message=i.message,
        restarts=i.restarts,
        started_at=i.started_at or 0.0,
        finished_at=i.finished_at or 0.0,
        generation=generation,
    )
    if i.exit_code is not None:
        msg.exit_code = i.exit_code
    if i.address:
        msg.address = i.address
    if i.host_ip:
        msg.host_ip = i.host_ip
    if i.ports:
        msg.ports.extend(binding_to_pb(b) for b in i.ports)
    if i.health is not HealthState.UNKNOWN:
        msg.health = _HEALTH_TO_PB[i.health]
    if i.health_message:
        msg.health_message = i.health_message
    if i.health_changed_at is not None:
        msg.health_time = i.health_changed_at
    if resources is not None:
        msg.resources.cpu_millis = resources.cpu_millis
        msg.resources.memory_bytes = resources.memory_bytes
    return msg


# Bounds on what an agent reports about an instance (instance names are `<workload>-<hex>`).
MAX_INSTANCE_NAME = 253
MAX_REASON = 256
MAX_STATUS_MESSAGE = 4096


def report_from_pb(msg: apb.InstanceStatus, node: str) -> InstanceReport:
    """Agent input: validated here, so a bad message is rejected before it touches state."""
    if not msg.name:
        raise Invalid("instance status: name is required")
    name = msg.name
    if len(name) > MAX_INSTANCE_NAME or len(msg.workload) > MAX_INSTANCE_NAME:
        raise Invalid(
            f"instance status {quote(name)}: name and workload must be at most"
            f" {MAX_INSTANCE_NAME} characters"
        )
    return InstanceReport(
        name=name,
        workload=msg.workload,
        node=node,
        # The field's name is only formatted for an error (reports arrive by the thousand).
        phase=_REPORTED_PHASE_FROM_PB.get(msg.phase)
        or _reported_phase(msg.phase, f"instance status {name}: phase"),
        # What a runtime said can be long (a stack, a log line): kept, but cut.
        reason=msg.reason[:MAX_REASON],
        message=msg.message[:MAX_STATUS_MESSAGE],
        exit_code=msg.exit_code if msg.HasField("exit_code") else None,
        restarts=msg.restarts,
        # Field names are only formatted into an error (reports arrive by the thousand).
        started_at=_time(msg.started_at, name, "started_at"),
        finished_at=_time(msg.finished_at, name, "finished_at"),
        address=_ip(msg.address, name, "address"),
        host_ip=_ip(msg.host_ip, name, "host_ip"),
        ports=_reported_ports(msg.ports, name) if msg.ports else [],
        health=_HEALTH_FROM_PB.get(msg.health)
        or health_from_pb(msg.health, f"instance status {name}: health"),
        health_message=msg.health_message[:MAX_STATUS_MESSAGE],
        health_changed_at=_time(msg.health_time, name, "health_time"),
    )


def _ip(text: str, name: str, field: str) -> str:
    """An address an agent reports: an IP or nothing; it is shown to users and dialled by
    them, so nothing else (a name, a URL) passes."""
    if not text:
        return ""
    if len(text) > MAX_IP_TEXT:
        raise Invalid(
            f"instance status {name}: {field}: not an IP address (over {MAX_IP_TEXT} characters)"
        )
    canonical = _canonical_ip(text)
    if canonical is None:
        raise Invalid(f"instance status {name}: {field}: {quote(text)} is not an IP address")
    return canonical


@functools.lru_cache(maxsize=4096)
def _canonical_ip(text: str) -> str | None:
    """The IP's usual text form, None when it is no IP. Cached: a node's reports repeat its
    host IP, and parsing one costs more than the rest of a report."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


MAX_IP_TEXT = 45  # the longest IPv6 text form


def _reported_ports(ports: Iterable[pb.PortBinding], name: str) -> list[PortBinding]:
    out = []
    for i, msg in enumerate(ports):
        what = f"instance status {name}: ports[{i}]"
        if i >= MAX_PORTS:
            raise Invalid(f"instance status {name}: ports: at most {MAX_PORTS}")
        if not 0 <= msg.port <= 65535 or not 0 <= msg.host_port <= 65535:
            raise Invalid(f"{what}: port and host_port must be 0-65535")
        try:
            check_name(msg.name, "name")
        except ValueError as err:
            raise Invalid(f"{what}: {err}") from None
        if len(msg.name) > MAX_PORT_NAME:
            raise Invalid(f"{what}: name must be at most {MAX_PORT_NAME} characters")
        out.append(
            PortBinding(
                name=msg.name,
                port=msg.port,
                host_port=msg.host_port,
                protocol=_protocol(msg.protocol, f"{what}.protocol"),
            )
        )
    return out


def _time(seconds: float, name: str, field: str) -> float | None:
    """An agent's Unix time; 0 means unknown. NaN or infinity is no time, and could not even
    be stored (the store's JSON has no such numbers)."""
    if not seconds:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        raise Invalid(
            f"instance status {name}: {field}: must be a time in seconds since 1970,"
            f" got {seconds!r}"
        )
    return seconds


# ---- google.rpc.Status of the agent protocol (offer replies, acks, command results) ----


def ok_status() -> status_pb2.Status:
    return status_pb2.Status(code=code_pb2.OK)


def error_status(code: int, message: str) -> status_pb2.Status:
    """`code` is a google.rpc.Code (code_pb2.FAILED_PRECONDITION, ...), never OK."""
    return status_pb2.Status(code=code, message=message)


def status_ok(status: status_pb2.Status) -> bool:
    return status.code == code_pb2.OK
