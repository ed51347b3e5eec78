"""Domain models shared by every service.

Protobuf stops at the servicers: they convert to and from these pydantic models in
`orka/*/convert.py`, and everything behind them works on these types only.
"""

from __future__ import annotations

import posixpath
import re
import time
from enum import StrEnum

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from orka import validation as checks
from orka.etags import new_workload_etag
from orka.validation import MAX_NAME_LENGTH, quote

MAX_REPLICAS = 1000
MAX_STOP_GRACE_SECONDS = 3600
# The longest a lost node's instances may be waited for (WorkloadSpec.max_disconnect).
MAX_DISCONNECT_SECONDS = 7 * 24 * 3600
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# A user or group a process workload runs as: a name (POSIX portable user names, as useradd
# takes them) or a numeric id. Nothing else, so no NUL, control character or path reaches
# getpwnam or a log line; 32 is the longest name useradd accepts.
MAX_ACCOUNT_LENGTH = 32
_ACCOUNT_RE = re.compile(r"^(?:[0-9]{1,10}|[A-Za-z_][A-Za-z0-9_.-]{0,30}[A-Za-z0-9_.$-]?)$")
# What Get, List and Watch return in place of each secret_env value; an Update that sends it
# back for a key keeps the stored secret (see orka/controller/secrets.py).
REDACTED = "<redacted>"
MAX_SECRET_KEY_BYTES = 256
MAX_SECRET_VALUE_BYTES = 64 * 1024
MAX_SECRET_ENV_BYTES = 256 * 1024
MAX_SECRET_FILES = 64
MAX_PATH_CHARS = 4096


class Model(BaseModel):
    """The base of every model here. Each builds its validator on first use rather than at
    import: a process uses a few of them (a scheduler, an agent, a CLI call), and building
    all of them was about 90 ms of every process start."""

    model_config = ConfigDict(defer_build=True)


def _check_secret_key(key: str) -> None:
    # Messages name the key, never a value: the value is the secret.
    if not key or "=" in key or "\0" in key or len(key) > MAX_SECRET_KEY_BYTES:
        raise ValueError(
            f"key {key[:MAX_SECRET_KEY_BYTES]!r} must be 1-{MAX_SECRET_KEY_BYTES}"
            " characters without '=' or NUL"
        )


class WorkloadKind(StrEnum):
    PROCESS = "PROCESS"
    CONTAINER = "CONTAINER"
    VM = "VM"


# The runtime driver a node needs to run a kind; `fake` serves every kind.
KIND_DRIVER: dict[WorkloadKind, str] = {
    WorkloadKind.PROCESS: "process",
    WorkloadKind.CONTAINER: "containerd",
    WorkloadKind.VM: "libvirt",
}
FAKE_DRIVER = "fake"
# A container image read from an OCI archive on the node rather than pulled from a registry.
OCI_ARCHIVE_PREFIX = "oci-archive:"


class RestartPolicy(StrEnum):
    ALWAYS = "ALWAYS"
    ON_FAILURE = "ON_FAILURE"
    NEVER = "NEVER"


class InstancePhase(StrEnum):
    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    LOST = "LOST"
    # Its node is LOST and its workload waits for the node (on_node_lost: wait): it may still
    # run there; not replaced until max_disconnect has passed. Set by the controller only.
    DISCONNECTED = "DISCONNECTED"


class OnNodeLost(StrEnum):
    """What the controller does with the instances of a LOST node (WorkloadSpec.on_node_lost)."""

    # Lose them and place replacements at once (the default).
    REPLACE = "REPLACE"
    # Keep them DISCONNECTED for max_disconnect, then replace them.
    WAIT = "WAIT"


class HealthState(StrEnum):
    """What an instance's health check says (reported by its agent). An instance without a
    check is HEALTHY while it runs; UNKNOWN: not running, or the check has not yet passed
    `success_threshold` times nor failed `failure_threshold` times."""

    UNKNOWN = "UNKNOWN"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"


# Phases after which an instance never runs again.
TERMINAL_PHASES = frozenset(
    {InstancePhase.SUCCEEDED, InstancePhase.FAILED, InstancePhase.STOPPED, InstancePhase.LOST}
)
# The phases each transition starts from (DESIGN.md, "Instance, node and workload states").
_UNBOUND = frozenset({InstancePhase.PENDING})
_JUST_BOUND = frozenset({InstancePhase.SCHEDULED})
_LIVE = frozenset(InstancePhase) - TERMINAL_PHASES
# What a lost node may still run: bound and live, not yet disconnected.
_WAITABLE = frozenset(
    {
        InstancePhase.SCHEDULED,
        InstancePhase.STARTING,
        InstancePhase.RUNNING,
        InstancePhase.STOPPING,
    }
)
# Phases in which an instance holds (or is about to hold) a node's resources.
BOUND_PHASES = frozenset(
    {
        InstancePhase.SCHEDULED,
        InstancePhase.STARTING,
        InstancePhase.RUNNING,
        InstancePhase.STOPPING,
    }
)


class InstanceReason(StrEnum):
    """Why the controller moved an instance (or wants it stopped). The value is the `reason`
    users see; a stop's reason shows only in its message (`Instance.stop`)."""

    # Placement (orka/controller/placement.py).
    SCHEDULED = "Scheduled"
    UNSCHEDULABLE = "Unschedulable"
    START_REFUSED = "StartRefused"
    # A volume it uses is missing, being deleted, failed, lost or held by another instance.
    VOLUME_UNAVAILABLE = "VolumeUnavailable"
    # Loss: the node is gone, or came back without the instance.
    NODE_LOST = "NodeLost"
    NOT_ON_NODE = "NotOnNode"
    # Its node is lost and the workload waits for it (on_node_lost: wait).
    NODE_DISCONNECTED = "NodeDisconnected"
    # Stops the controller asks for.
    SCALED_DOWN = "ScaledDown"
    REPLACED = "Replaced"
    WORKLOAD_DELETED = "WorkloadDeleted"
    # A replacement never placed, dropped because the instance it replaced came back.
    ORIGINAL_BACK = "OriginalBack"


# What a stop tells the node and the user (the stored message, the stop command's reason).
STOP_MESSAGES: dict[InstanceReason, str] = {
    InstanceReason.SCALED_DOWN: "scaled down",
    InstanceReason.REPLACED: "replaced by {successor}",
    InstanceReason.WORKLOAD_DELETED: "workload deleted",
    InstanceReason.ORIGINAL_BACK: "not needed: {successor} is back on its node",
}
LOSS_REASONS = frozenset({InstanceReason.NODE_LOST, InstanceReason.NOT_ON_NODE})


class InvalidTransition(ValueError):
    """A transition asked of an instance in a phase it cannot leave that way: a controller bug
    (every caller checks the phase first), refused so that no record is written wrong."""


class NodeState(StrEnum):
    READY = "READY"
    NOT_READY = "NOT_READY"
    LOST = "LOST"
    LEFT = "LEFT"


def check_name(value: str, field: str = "name") -> str:
    """Names are DNS labels, like Kubernetes object names, so they fit hosts and paths."""
    if not value:
        raise ValueError(f"{field} is required")
    if len(value) > MAX_NAME_LENGTH or not _NAME_RE.match(value):
        raise ValueError(
            f"{field} {quote(value)} must be 1-{MAX_NAME_LENGTH} lowercase letters, digits or '-',"
            " starting and ending with a letter or digit"
        )
    return value


def check_account(value: str) -> str:
    """A user or group: a name or a numeric id, bounded, nothing a lookup or a log could trip on.

    The error quotes at most MAX_ACCOUNT_LENGTH characters of the value, never all of it."""
    if value and not _ACCOUNT_RE.match(value):
        shown = repr(value[:MAX_ACCOUNT_LENGTH]) + (
            "..." if len(value) > MAX_ACCOUNT_LENGTH else ""
        )
        raise ValueError(
            "must be a user or group name (letters, digits, '_', '.', '-', at most"
            f" {MAX_ACCOUNT_LENGTH} characters) or a numeric id, got {shown}"
        )
    if value.isdigit() and int(value) > 0xFFFFFFFE:
        raise ValueError(f"numeric id {value} is out of range")
    return value


class Resources(Model):
    model_config = ConfigDict(frozen=True)

    cpu_millis: int = Field(default=0, ge=0)
    memory_bytes: int = Field(default=0, ge=0)

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            cpu_millis=self.cpu_millis + other.cpu_millis,
            memory_bytes=self.memory_bytes + other.memory_bytes,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            cpu_millis=self.cpu_millis - other.cpu_millis,
            memory_bytes=self.memory_bytes - other.memory_bytes,
        )

    def fits_in(self, free: Resources) -> bool:
        return self.cpu_millis <= free.cpu_millis and self.memory_bytes <= free.memory_bytes


class PortProtocol(StrEnum):
    TCP = "tcp"
    UDP = "udp"


MAX_PORTS = 32
MAX_PORT_NAME = 15  # IANA service names, as Kubernetes limits port names


class PortSpec(Model):
    """A port an instance serves: `port` inside its own network, `host_port` on its node.

    `host_port` 0 lets the agent pick a free one; a host-network process has no network of its
    own, so it gives only `host_port` (or the same number in both).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    port: int | None = Field(default=None, ge=1, le=65535)
    host_port: int = Field(default=0, ge=0, le=65535)
    protocol: PortProtocol = PortProtocol.TCP

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > MAX_PORT_NAME:
            raise ValueError(f"{quote(v)} must be at most {MAX_PORT_NAME} characters")
        return check_name(v)

    @property
    def env_name(self) -> str:
        """The variable a process reads the port it listens on from: ORKA_PORT_<NAME>."""
        return "ORKA_PORT_" + self.name.upper().replace("-", "_")

    @property
    def host_env_name(self) -> str:
        """Where it is reached on its node: ORKA_HOST_PORT_<NAME>."""
        return "ORKA_HOST_PORT_" + self.name.upper().replace("-", "_")


class NetworkMode(StrEnum):
    """Where an instance's network lives: the node's own (processes by default) or a
    namespace of its own on the node's bridge, with its own address (containers and VMs
    always; processes when they ask)."""

    HOST = "host"
    BRIDGE = "bridge"


class PortBinding(Model):
    """A port as an instance got it: `host_port` is the one actually bound on the node."""

    model_config = ConfigDict(frozen=True)

    name: str
    port: int = 0
    host_port: int = 0
    protocol: PortProtocol = PortProtocol.TCP


MAX_CHECK_SECONDS = 3600
MAX_CHECK_THRESHOLD = 100
MAX_CHECK_PATH = 1024
MIN_CHECK_INTERVAL = 0.1


class ExecCheck(Model):
    """Run a command inside the instance (a process's own user, directory, environment and
    namespaces); exit code 0 passes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    command: list[checks.Arg] = Field(min_length=1, max_length=checks.MAX_ARGS)


def _check_port(value: object) -> object:
    # YAML writes `port: 8080` unquoted: a number means that port, a name one of `ports`.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class TcpCheck(Model):
    """Connect to a port of the instance; an accepted connection passes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The name of one of the workload's ports, or a port number.
    port: str

    _port = field_validator("port", mode="before")(_check_port)


class HttpCheck(Model):
    """GET `path` on a port of the instance; a status in [status_min, status_max] passes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    port: str
    path: str = "/"
    status_min: int = Field(default=200, ge=100, le=599)
    status_max: int = Field(default=399, ge=100, le=599)

    _port = field_validator("port", mode="before")(_check_port)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        # It goes into a request line as it is: printable ASCII, no space.
        if not v.startswith("/") or len(v) > MAX_CHECK_PATH or not all("!" <= c <= "~" for c in v):
            raise ValueError(
                f"must start with '/' and be at most {MAX_CHECK_PATH} printable ASCII"
                " characters without spaces"
            )
        return v


class HealthCheck(Model):
    """A check the agent runs against each running instance (Nomad's check with
    check_restart). Exactly one of exec, tcp, http. Spans are seconds (Durations on the wire).
    `failure_threshold` failures in a row make it UNHEALTHY, and the agent restarts it per the
    restart policy (with NEVER it keeps running, UNHEALTHY); `success_threshold` passes in a row
    make it HEALTHY."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exec: ExecCheck | None = None
    tcp: TcpCheck | None = None
    http: HttpCheck | None = None
    interval: float = Field(default=10.0, ge=MIN_CHECK_INTERVAL, le=MAX_CHECK_SECONDS)
    timeout: float = Field(default=2.0, gt=0, le=MAX_CHECK_SECONDS)
    initial_delay: float = Field(default=0.0, ge=0, le=MAX_CHECK_SECONDS)
    failure_threshold: int = Field(default=3, ge=1, le=MAX_CHECK_THRESHOLD)
    success_threshold: int = Field(default=1, ge=1, le=MAX_CHECK_THRESHOLD)

    @property
    def mode(self) -> str:
        return "exec" if self.exec else "tcp" if self.tcp else "http"

    @property
    def port(self) -> str:
        """The port a tcp or http check targets (a name or a number); "" for exec."""
        target = self.tcp or self.http
        return target.port if target is not None else ""


class VmSpec(Model):
    model_config = ConfigDict(frozen=True)

    kernel: checks.AbsPath = ""
    initrd: checks.AbsPath = ""
    cmdline: checks.CmdLine = ""


# Rollout bounds: how long an instance must stay ready, and how long a rollout may go
# without progress, at most; how many revisions of a workload are kept.
MAX_MIN_READY_SECONDS = 3600
MAX_PROGRESS_DEADLINE_SECONDS = 86400
MAX_REVISIONS = 10
# ... and at most this many bytes of earlier specs in all (JSON), so that a workload record
# stays well inside a store's value limit (etcd takes 1.5 MiB per request) with big specs.
MAX_REVISION_BYTES = 256 << 10


class UpdateStrategy(Model):
    """How a changed spec replaces running instances (`WorkloadSpec.update`).

    Defaults keep the workload at full strength: one extra new instance at a time (max_surge 1)
    and none taken away before its successor is ready (max_unavailable 0), as Orka replaced
    instances before; Kubernetes' 25 %/25 % suits large workloads, where an operator sets it.
    A rollout that makes no progress for `progress_deadline_seconds` (or whose new instances
    fail) stops; with `auto_rollback` it returns to the last revision that completed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # At most this many of `replicas` may be not ready during the rollout.
    max_unavailable: int = Field(default=0, ge=0, le=MAX_REPLICAS)
    # At most this many instances above `replicas` may run during the rollout.
    max_surge: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    # A new instance counts as ready once RUNNING and HEALTHY for this long.
    min_ready_seconds: int = Field(default=0, ge=0, le=MAX_MIN_READY_SECONDS)
    progress_deadline_seconds: int = Field(default=600, ge=1, le=MAX_PROGRESS_DEADLINE_SECONDS)
    auto_rollback: bool = False
    # > 0: replace only this many instances, then wait for `orka rollout promote`.
    canary: int = Field(default=0, ge=0, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _moves(self) -> UpdateStrategy:
        if self.max_unavailable == 0 and self.max_surge == 0:
            raise ValueError(
                "max_surge: must be at least 1 when max_unavailable is 0 (with both 0 no"
                " instance could ever be replaced)"
            )
        return self


MAX_VOLUMES = 16
DEFAULT_POOL = "default"
# Volume backends an agent may offer: a directory of enforced size (an ext4 file system on a
# loop-mounted sparse file) for processes and containers, a qcow2 disk for VMs.
VOLUME_BACKENDS = ("ext4", "qcow2")
MIN_VOLUME_BYTES = 1 << 20
MAX_VOLUME_BYTES = 1 << 50


def volume_env_key(name: str) -> str:
    """The variable a PROCESS finds a volume's host path in: ORKA_VOLUME_<NAME>."""
    return "ORKA_VOLUME_" + re.sub(r"[^A-Z0-9]", "_", name.upper())


def backend_for(kind: WorkloadKind) -> str:
    """The backend a volume gets when neither it nor its class names one."""
    return "qcow2" if kind is WorkloadKind.VM else "ext4"


def _check_mount_path(value: str) -> str:
    if value and (
        not value.startswith("/")
        or "\0" in value
        or len(value) > MAX_PATH_CHARS
        or posixpath.normpath(value) != value
        or value == "/"
    ):
        raise ValueError(
            f"{quote(value)} must be an absolute, normalised path other than / (no '..', '.'"
            " or '//')"
        )
    return value


class VolumeMount(Model):
    """A volume in a workload (see proto VolumeMount)."""

    model_config = ConfigDict(frozen=True)

    volume: str
    mount_path: str = ""
    read_only: bool = False

    @field_validator("volume")
    @classmethod
    def _volume(cls, v: str) -> str:
        return check_name(v, "volume")

    @field_validator("mount_path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_mount_path(v)


def _check_size(v: int) -> int:
    if not MIN_VOLUME_BYTES <= v <= MAX_VOLUME_BYTES:
        raise ValueError(f"{v} bytes is not between 1Mi and 1Pi")
    return v


class VolumeTemplate(Model):
    """A volume per replica (see proto VolumeTemplate)."""

    model_config = ConfigDict(frozen=True)

    name: str
    size_bytes: int
    class_name: str = ""
    mount_path: str = ""
    read_only: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("class_name")
    @classmethod
    def _class(cls, v: str) -> str:
        return check_name(v, "class_name") if v else v

    @field_validator("size_bytes")
    @classmethod
    def _size(cls, v: int) -> int:
        return _check_size(v)

    @field_validator("mount_path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_mount_path(v)

    def volume_name(self, workload: str, ordinal: int) -> str:
        return f"{self.name}-{workload}-{ordinal}"


class WorkloadSpec(Model):
    """What a user declares. Validation errors name the offending field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: WorkloadKind
    image: str = ""
    command: list[checks.Arg] = Field(default_factory=list, max_length=checks.MAX_ARGS)
    env: dict[checks.EnvKey, checks.EnvValue] = Field(
        default_factory=dict, max_length=checks.MAX_ENV_ENTRIES
    )
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[checks.LabelKey, checks.LabelValue] = Field(
        default_factory=dict, max_length=checks.MAX_SELECTOR_ENTRIES
    )
    restart_policy: RestartPolicy = RestartPolicy.ALWAYS
    vm: VmSpec | None = None
    working_dir: checks.AbsPath = ""
    # Spread rule: at most this many replicas of the workload on one node (0: no limit).
    max_per_node: int = Field(default=0, ge=0)
    # Seconds between SIGTERM and SIGKILL when an instance is stopped.
    stop_grace_seconds: float = Field(default=10.0, ge=0, le=MAX_STOP_GRACE_SECONDS)
    # Who a PROCESS instance runs as (name or numeric id); empty: the agent's --workload-user.
    user: str = ""
    # Its group; empty: the user's primary group.
    group: str = ""
    # Environment values that are never logged nor returned in clear (see REDACTED).
    secret_env: dict[str, str] = Field(default_factory=dict, repr=False)
    # KEY -> absolute path of a file on the node whose content the agent puts in KEY at each
    # start (orka/agent/secret_files.py); the path must be inside the agent's --secret-dir.
    secret_env_files: dict[str, str] = Field(default_factory=dict)
    # Ports the instance serves (see PortSpec); fixed host ports are a node resource.
    ports: list[PortSpec] = Field(default_factory=list, max_length=MAX_PORTS)
    # None: the kind's own (host for a process, bridge for containers and VMs).
    network: NetworkMode | None = None
    # How a change of the spec rolls out (see UpdateStrategy).
    update: UpdateStrategy = Field(default_factory=UpdateStrategy)
    # A check the agent runs against each running instance (see HealthCheck).
    health_check: HealthCheck | None = None
    # A COMPUTE class: resolved into `resources` when the workload is written (see proto).
    class_name: str = ""
    pool: str = ""
    volumes: list[VolumeMount] = Field(default_factory=list, max_length=MAX_VOLUMES)
    volume_template: VolumeTemplate | None = None
    # What a LOST node's instances become (see OnNodeLost), and with WAIT how many seconds
    # they are waited for (required with WAIT, 0 otherwise).
    on_node_lost: OnNodeLost = OnNodeLost.REPLACE
    max_disconnect: float = Field(default=0.0, ge=0, le=MAX_DISCONNECT_SECONDS)

    @field_validator("class_name", "pool")
    @classmethod
    def _optional_name(cls, v: str, info: ValidationInfo) -> str:
        return check_name(v, info.field_name or "name") if v else v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("image")
    @classmethod
    def _image(cls, value: str, info: ValidationInfo) -> str:
        """A VM's image is a disk on the node and an `oci-archive:` image a file there: both
        are paths, held to the path rules; any other image is a registry reference."""
        kind = info.data.get("kind")
        checks.check_text(value, checks.MAX_IMAGE_LENGTH)
        if kind is WorkloadKind.VM and value:
            checks.check_path(value)
        elif kind is WorkloadKind.CONTAINER and value.startswith(OCI_ARCHIVE_PREFIX):
            checks.check_path(value.removeprefix(OCI_ARCHIVE_PREFIX))
        return value

    @field_validator("user", "group")
    @classmethod
    def _account(cls, v: str) -> str:
        return check_account(v)

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, v: dict[str, str]) -> dict[str, str]:
        # Messages name the key, never the value: the value is the secret.
        total = 0
        for key, value in v.items():
            _check_secret_key(key)
            size = len(value.encode())
            if "\0" in value or size > MAX_SECRET_VALUE_BYTES:
                raise ValueError(
                    f"the value of {key!r} must be at most {MAX_SECRET_VALUE_BYTES} bytes"
                    " without NUL"
                )
            total += len(key) + size
        if total > MAX_SECRET_ENV_BYTES:
            raise ValueError(f"must be at most {MAX_SECRET_ENV_BYTES} bytes in all")
        return v

    @field_validator("secret_env_files")
    @classmethod
    def _secret_env_files(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_SECRET_FILES:
            raise ValueError(f"at most {MAX_SECRET_FILES} files, got {len(v)}")
        for key, path in v.items():
            _check_secret_key(key)
            if (
                len(path) > MAX_PATH_CHARS
                or not path.startswith("/")
                or "\0" in path
                or posixpath.normpath(path) != path
            ):
                raise ValueError(
                    f"the path of {key!r} must be absolute and normalised (no '..', '.' or"
                    f" '//'), at most {MAX_PATH_CHARS} characters without NUL"
                )
        return v

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[PortSpec]) -> list[PortSpec]:
        names: set[str] = set()
        fixed: set[tuple[int, PortProtocol]] = set()
        for i, p in enumerate(v):
            if p.name in names:
                raise ValueError(f"[{i}].name: {quote(p.name)} is given twice")
            names.add(p.name)
            if p.host_port:
                if (p.host_port, p.protocol) in fixed:
                    raise ValueError(f"[{i}].host_port: {p.host_port}/{p.protocol} is given twice")
                fixed.add((p.host_port, p.protocol))
        return v

    @model_validator(mode="after")
    def _node_lost_policy(self) -> WorkloadSpec:
        if self.on_node_lost is OnNodeLost.WAIT and self.max_disconnect <= 0:
            raise ValueError(
                "max_disconnect: required with on_node_lost WAIT: how long a lost node's"
                f" instances are waited for (more than 0s, at most {MAX_DISCONNECT_SECONDS}s)"
            )
        if self.on_node_lost is not OnNodeLost.WAIT and self.max_disconnect:
            raise ValueError(
                "max_disconnect: only with on_node_lost WAIT (REPLACE replaces a lost node's"
                " instances at once)"
            )
        return self

    @model_validator(mode="after")
    def _kind_needs(self) -> WorkloadSpec:
        if self.kind is WorkloadKind.PROCESS and not self.command:
            raise ValueError("command is required for a PROCESS workload")
        if self.kind is not WorkloadKind.PROCESS and (self.user or self.group):
            # Only the process driver switches users; silently ignoring it would be worse.
            raise ValueError("user and group apply to PROCESS workloads only")
        if self.kind is WorkloadKind.CONTAINER and not self.image:
            raise ValueError("image is required for a CONTAINER workload")
        if self.kind is WorkloadKind.VM and not self.image and not (self.vm and self.vm.kernel):
            raise ValueError("image or vm.kernel is required for a VM workload")
        if self.kind is not WorkloadKind.PROCESS and self.network is NetworkMode.HOST:
            raise ValueError(
                "network: host is for PROCESS workloads only; containers and VMs always get a"
                " network of their own"
            )
        for i, p in enumerate(self.ports):
            if not self.own_network:
                if p.port is not None and p.port != p.host_port:
                    raise ValueError(
                        f"ports[{i}].port: a host-network process listens on its host port;"
                        " give host_port only (0 lets the agent pick one)"
                    )
            elif p.port is None:
                raise ValueError(
                    f"ports[{i}].port: required where an instance has a network of its own"
                    f" ({self.kind.value}, network: bridge): where it listens there"
                )
        both = sorted(self.env.keys() & self.secret_env.keys())
        if both:
            raise ValueError(f"secret_env: {both[0]!r} is also in env; give each variable once")
        both = sorted(self.secret_env_files.keys() & (self.env.keys() | self.secret_env.keys()))
        if both:
            raise ValueError(
                f"secret_env_files: {both[0]!r} is also in env or secret_env; give each"
                " variable once"
            )
        if self.health_check is not None:
            self._check_health(self.health_check)
        self._check_volumes()
        return self

    def _check_volumes(self) -> None:
        mounts: list[tuple[str, str, str, bool]] = [
            (f"volumes[{i}]", m.volume, m.mount_path, m.read_only)
            for i, m in enumerate(self.volumes)
        ]
        if self.volume_template is not None:
            t = self.volume_template
            mounts.append(("volume_template", t.name, t.mount_path, t.read_only))
        names: set[str] = set()
        paths: set[str] = set()
        for where, name, path, _ in mounts:
            if name in names:
                raise ValueError(f"{where}.volume: {quote(name)} is given twice")
            names.add(name)
            if self.kind is WorkloadKind.CONTAINER and not path:
                raise ValueError(
                    f"{where}.mount_path: is required for a CONTAINER (where it sees the volume)"
                )
            if path and path in paths:
                raise ValueError(f"{where}.mount_path: {quote(path)} is used by two volumes")
            paths.add(path)

    def _check_health(self, check: HealthCheck) -> None:
        # Messages start with the field's path: the API reports each as a field violation.
        given = [m for m in ("exec", "tcp", "http") if getattr(check, m) is not None]
        if len(given) != 1:
            raise ValueError(
                "health_check: give exactly one of exec, tcp or http"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if check.exec is not None and self.kind is WorkloadKind.VM:
            # A command runs in a process's context or a container (its driver's exec); a VM
            # has no such way in (its console is a terminal, not a command runner).
            raise ValueError(
                "health_check.exec: exec checks are for PROCESS and CONTAINER workloads; use"
                " tcp or http for a VM"
            )
        if check.timeout > check.interval:
            raise ValueError(
                f"health_check.timeout: {check.timeout:g}s is longer than the interval"
                f" ({check.interval:g}s)"
            )
        if check.http is not None and check.http.status_min > check.http.status_max:
            raise ValueError(
                f"health_check.http.status_min: {check.http.status_min} is above status_max"
                f" {check.http.status_max}"
            )
        mode = check.mode
        port = check.port
        if mode != "exec" and not port:
            raise ValueError(f"health_check.{mode}.port: is required (a port's name or number)")
        if port.isdigit():
            if not 1 <= int(port) <= 65535:
                raise ValueError(f"health_check.{mode}.port: {port} is not a port (1-65535)")
        elif mode != "exec":
            spec = next((p for p in self.ports if p.name == port), None)
            if spec is None:
                raise ValueError(f"health_check.{mode}.port: no port named {quote(port)}")
            if spec.protocol is not PortProtocol.TCP:
                raise ValueError(
                    f"health_check.{mode}.port: {quote(port)} is {spec.protocol.value}; a"
                    f" {mode} check needs a tcp port"
                )

    @property
    def own_network(self) -> bool:
        """Whether an instance gets a network (and an address) of its own on the bridge."""
        if self.kind is WorkloadKind.PROCESS:
            return self.network is NetworkMode.BRIDGE
        return True

    @property
    def fixed_host_ports(self) -> frozenset[tuple[int, PortProtocol]]:
        """The exact host ports an instance needs on its node (a node resource)."""
        return frozenset((p.host_port, p.protocol) for p in self.ports if p.host_port)

    @property
    def environment(self) -> dict[str, str]:
        """What an instance's process sees: env and the secret values, for drivers only."""
        return {**self.env, **self.secret_env} if self.secret_env else self.env

    @property
    def driver(self) -> str:
        return KIND_DRIVER[self.kind]


class WorkloadStatus(Model):
    desired: int = 0
    placed: int = 0
    running: int = 0
    # Of the running ones, how many are HEALTHY.
    healthy: int = 0
    unschedulable_reasons: list[str] = Field(default_factory=list)
    # Some replica waits for what waiting cannot bring (see the proto's comment).
    unschedulable_unresolvable: bool = False
    message: str = ""
    # Of the active instances, how many run the current generation, and of those how many are
    # ready (RUNNING and HEALTHY for the spec's update.min_ready_seconds).
    updated: int = 0
    ready: int = 0


class RolloutState(StrEnum):
    """Where the rollout of a workload's current revision stands."""

    PROGRESSING = "PROGRESSING"
    PAUSED = "PAUSED"
    AWAITING_PROMOTION = "AWAITING_PROMOTION"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"
    ROLLED_BACK = "ROLLED_BACK"


# States in which the rollout moves instances by itself.
ROLLOUT_DONE = frozenset({RolloutState.COMPLETE, RolloutState.ROLLED_BACK})


class Rollout(Model):
    """The rollout of revision `revision` (kept on the workload record, so that a new leader
    carries on where the last one stopped)."""

    state: RolloutState = RolloutState.COMPLETE
    # The generation being rolled out.
    revision: int = 1
    # The last revision whose rollout completed: where an automatic rollback returns to.
    stable: int = 0
    # Set on the revision a rollback made: the revision that failed.
    rollback_of: int = 0
    message: str = ""
    # The last progress (an instance became ready or was replaced); FAILED past the deadline.
    progress_at: float = 0.0
    # When it began: only instances made since count as its failures (instances a rollback
    # adopted may have restarted long before).
    started_at: float = 0.0
    deadline: float = 0.0
    # `orka rollout promote` let a canary rollout go on.
    promoted: bool = False


class Revision(Model):
    """One spec a workload ran with (a generation that needed new instances)."""

    revision: int
    # None on the current revision: it is the workload's spec (stored once, not twice).
    spec: WorkloadSpec | None = None
    created_at: float = Field(default_factory=time.time)
    created_by: str = ""
    # Why it was made: "update", "rollback to revision 2", "undo to revision 2".
    cause: str = ""


class Workload(Model):
    spec: WorkloadSpec
    generation: int = 1
    deleting: bool = False
    # Deleted with `with_volumes`: its volumes go with it (orka/controller/volumes.py).
    delete_volumes: bool = False
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    # The caller's certificate identity ("admin/admin") at create and at the latest update.
    created_by: str = ""
    updated_by: str = ""
    status: WorkloadStatus = Field(default_factory=WorkloadStatus)
    # Drawn anew by each user write that changes the workload (orka/etags.py).
    etag: str = Field(default_factory=new_workload_etag)
    rollout: Rollout = Field(default_factory=Rollout)
    # The newest MAX_REVISIONS revisions, oldest first.
    revisions: list[Revision] = Field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    def history(self) -> list[Revision]:
        """The revisions kept, oldest first, each with its spec (the current one's filled in)."""
        return [
            r if r.spec is not None else r.model_copy(update={"spec": self.spec})
            for r in self.revisions
        ]

    def revision(self, number: int) -> Revision | None:
        for r in self.history():
            if r.revision == number:
                return r
        return None


class Instance(Model):
    name: str
    workload: str
    generation: int = 1
    node: str = ""
    phase: InstancePhase = InstancePhase.PENDING
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    restarts: int = 0
    # Set when the controller wants this instance gone (scale down, delete, replaced).
    desired_stop: bool = False
    # Name of the instance that replaces this one while its node drains.
    replaced_by: str = ""
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    scheduled_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    # The instance's IP in its node's instance network (empty: host network or not started),
    # its node's address (where host ports are reached) and the ports it got.
    address: str = ""
    host_ip: str = ""
    ports: list[PortBinding] = Field(default_factory=list)
    # Its health (see HealthState), the last failed check's message, and when the health last
    # changed (a rollout counts an instance ready once it has been HEALTHY long enough).
    health: HealthState = HealthState.UNKNOWN
    health_message: str = ""
    health_changed_at: float | None = None
    # Which replica it is: a replacement takes its predecessor's (and its template volume).
    ordinal: int = 0
    # When it became DISCONNECTED (its node lost, its workload waiting): the wait counts from
    # here. None when it is not DISCONNECTED.
    disconnected_at: float | None = None

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    # ---- transitions: each returns the new record and refuses a phase it cannot come from
    # (DESIGN.md, "Instance, node and workload states"). The records are values: a plan writes
    # the returned copy, the stored one is left as it is.

    def _require(self, what: str, phases: frozenset[InstancePhase]) -> None:
        if self.phase not in phases:
            raise InvalidTransition(f"instance {self.name}: cannot {what} from {self.phase}")

    def scheduled(self, node: str, now: float) -> Instance:
        """PENDING -> SCHEDULED: the controller wrote the binding an accepted offer made."""
        self._require("be scheduled", _UNBOUND)
        return self.model_copy(
            update={
                "phase": InstancePhase.SCHEDULED,
                "node": node,
                "reason": InstanceReason.SCHEDULED.value,
                "message": "",
                "scheduled_at": now,
                "updated_at": now,
            }
        )

    def unschedulable(self, why: str, now: float) -> Instance:
        """Stays PENDING, saying why no node took it (the scheduler's reasons per node)."""
        self._require("be unschedulable", _UNBOUND)
        return self.model_copy(
            update={
                "reason": InstanceReason.UNSCHEDULABLE.value,
                "message": why,
                "updated_at": now,
            }
        )

    def volume_unavailable(self, why: str, now: float) -> Instance:
        """Stays PENDING, not offered to any node, until its volume can be used."""
        self._require("wait for a volume", _UNBOUND)
        return self.model_copy(
            update={
                "reason": InstanceReason.VOLUME_UNAVAILABLE.value,
                "message": why,
                "updated_at": now,
            }
        )

    def start_refused(self, error: str, now: float) -> Instance:
        """SCHEDULED -> PENDING on no node: its node refused the start, so it is placed again."""
        self._require("have its start refused", _JUST_BOUND)
        return self.model_copy(
            update={
                "phase": InstancePhase.PENDING,
                "node": "",
                "reason": InstanceReason.START_REFUSED.value,
                "message": f"node {self.node}: {error}",
                "updated_at": now,
            }
        )

    def lost(self, reason: InstanceReason, message: str, now: float) -> Instance:
        """A live instance -> LOST: it runs nowhere the controller can see, and is replaced."""
        if reason not in LOSS_REASONS:
            raise InvalidTransition(f"{reason} is not a reason to lose an instance")
        self._require("be lost", _LIVE)
        return self.model_copy(
            update={
                "phase": InstancePhase.LOST,
                "reason": reason.value,
                "message": message,
                "finished_at": now,
                "updated_at": now,
            }
        )

    def disconnected(self, message: str, now: float) -> Instance:
        """A bound live instance whose node is lost -> DISCONNECTED: kept, not replaced, while
        its workload waits for the node (on_node_lost: wait)."""
        self._require("be disconnected", _WAITABLE)
        return self.model_copy(
            update={
                "phase": InstancePhase.DISCONNECTED,
                "reason": InstanceReason.NODE_DISCONNECTED.value,
                "message": message,
                "disconnected_at": now,
                "updated_at": now,
            }
        )

    def reconnected(self, r: InstanceReport, now: float) -> Instance:
        """Its node came back and reports it still live: it takes the reported state again,
        as if never lost. From DISCONNECTED (waited for), or LOST by node loss (the controller
        then drops the replacement that was never placed)."""
        if self.phase is not InstancePhase.DISCONNECTED and not (
            self.phase is InstancePhase.LOST and self.reason == InstanceReason.NODE_LOST
        ):
            raise InvalidTransition(f"instance {self.name}: cannot reconnect from {self.phase}")
        if r.phase in TERMINAL_PHASES or r.phase in _UNBOUND:
            raise InvalidTransition(f"instance {self.name}: a {r.phase} report is not live")
        update: dict[str, object] = {f: getattr(r, f) for f in _REPORTED}
        update.update(message=r.message, disconnected_at=None, updated_at=now)
        if self.phase is InstancePhase.LOST:
            update["finished_at"] = r.finished_at
        return self.model_copy(update=update)

    def stop(self, reason: InstanceReason, now: float, successor: str = "") -> Instance:
        """Ask a live instance to stop. A wish, not a phase: phase and reason stay what the node
        reports until it has stopped; the message says why (and is what the node is told)."""
        template = STOP_MESSAGES.get(reason)
        if template is None:
            raise InvalidTransition(f"{reason} is not a reason to stop an instance")
        self._require("be stopped", _LIVE)
        return self.model_copy(
            update={
                "desired_stop": True,
                "message": template.format(successor=successor),
                "updated_at": now,
            }
        )

    def hand_over(self, successor: str) -> Instance:
        """A bound live instance gets a successor (drain, rolling update); it stops once the
        successor runs."""
        self._require("be replaced", BOUND_PHASES)
        return self.model_copy(update={"replaced_by": successor})

    def hand_over_failed(self) -> Instance:
        """Its successor failed or vanished: it stays, and may be replaced again."""
        self._require("take back its hand-over", _LIVE)
        return self.model_copy(update={"replaced_by": ""})

    def relabelled(self, generation: int) -> Instance:
        """A PENDING instance of an old generation simply becomes the new one: it has not run,
        so there is nothing to replace."""
        self._require("be relabelled", _UNBOUND)
        return self.model_copy(update={"generation": generation})

    def reported(self, r: InstanceReport, now: float) -> Instance | None:
        """Fold what its node reports into the record; None when nothing changed. The node is
        the truth for phases after SCHEDULED; a finished instance stays finished (a late
        report of an earlier phase is ignored), and a stop's message stays until the node
        says something of its own."""
        if r.phase is InstancePhase.SCHEDULED:
            return None
        if self.terminal and r.phase not in TERMINAL_PHASES:
            return None
        update: dict[str, object] = {}
        for field in _REPORTED:
            value = getattr(r, field)
            if getattr(self, field) != value:
                update[field] = value
        if r.message != self.message and not (self.desired_stop and not r.message):
            update["message"] = r.message
        if not update:
            return None
        if self.phase is InstancePhase.DISCONNECTED:
            update["disconnected_at"] = None  # its node is back: the wait is over
        update["updated_at"] = now
        return self.model_copy(update=update)


class Endpoint(Model):
    """Where a RUNNING instance of a workload is reached (ListEndpoints)."""

    instance: str
    node: str = ""
    address: str = ""
    host_ip: str = ""
    ports: list[PortBinding] = Field(default_factory=list)


# What an instance record takes from its node's reports as they are.
_REPORTED = (
    "phase",
    "reason",
    "exit_code",
    "restarts",
    "started_at",
    "finished_at",
    "address",
    "host_ip",
    "ports",
    "health",
    "health_message",
    "health_changed_at",
)


class Node(Model):
    name: str
    state: NodeState = NodeState.READY
    schedulable: bool = True
    draining: bool = False
    # Its agent is leaving (soft state from the scheduler; ends when it registers again).
    leaving: bool = False
    capacity: Resources = Field(default_factory=Resources)
    allocatable: Resources = Field(default_factory=Resources)
    allocated: Resources = Field(default_factory=Resources)
    usage: Resources = Field(default_factory=Resources)
    labels: dict[str, str] = Field(default_factory=dict)
    drivers: list[str] = Field(default_factory=list)
    instance_count: int = 0
    last_heartbeat: float = 0.0
    joined_at: float = Field(default_factory=time.time)
    message: str = ""
    pool: str = DEFAULT_POOL
    volume_backends: list[str] = Field(default_factory=list)
    volume_capacity_bytes: int = 0


class InstanceReport(Model):
    """What an agent says about one instance it runs (or ran)."""

    name: str
    workload: str = ""
    node: str = ""
    phase: InstancePhase
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    restarts: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    address: str = ""
    host_ip: str = ""
    ports: list[PortBinding] = Field(default_factory=list)
    health: HealthState = HealthState.UNKNOWN
    health_message: str = ""
    health_changed_at: float | None = None


# ---- pools, classes and volumes ----


class ComputeShape(Model):
    """What an instance of a COMPUTE class gets (see proto Class.Compute)."""

    resources: Resources = Field(default_factory=Resources)
    kinds: list[WorkloadKind] = Field(default_factory=list)


class VolumeShape(Model):
    """What a volume of a VOLUME class may be (see proto Class.Volume)."""

    min_size_bytes: int = Field(default=0, ge=0)
    max_size_bytes: int = Field(default=0, ge=0)
    backends: list[str] = Field(default_factory=list)
    immediate: bool = False

    @field_validator("backends")
    @classmethod
    def _backends(cls, v: list[str]) -> list[str]:
        for b in v:
            if b not in VOLUME_BACKENDS:
                raise ValueError(f"{quote(b)} is not a backend ({', '.join(VOLUME_BACKENDS)})")
        return v


class Class(Model):
    """A cluster-wide named shape: exactly one of compute and volume."""

    name: str
    compute: ComputeShape | None = None
    volume: VolumeShape | None = None
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    etag: str = Field(default_factory=new_workload_etag)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @model_validator(mode="after")
    def _one_shape(self) -> Class:
        if (self.compute is None) == (self.volume is None):
            raise ValueError("give exactly one of compute and volume")
        if self.compute is not None:
            r = self.compute.resources
            if not (r.cpu_millis or r.memory_bytes):
                raise ValueError("compute.resources: a class needs cpu or memory (or both)")
        if self.volume is not None and self.volume.max_size_bytes:
            if self.volume.min_size_bytes > self.volume.max_size_bytes:
                raise ValueError("volume.min_size_bytes: is above max_size_bytes")
        return self


class VolumeState(StrEnum):
    PENDING = "PENDING"
    AVAILABLE = "AVAILABLE"
    ATTACHED = "ATTACHED"
    RELEASED = "RELEASED"
    DELETING = "DELETING"
    FAILED = "FAILED"
    LOST = "LOST"


class VolumeSpec(Model):
    name: str
    size_bytes: int
    class_name: str = ""
    pool: str = ""
    backend: str = ""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("class_name", "pool")
    @classmethod
    def _optional_name(cls, v: str, info: ValidationInfo) -> str:
        return check_name(v, info.field_name or "name") if v else v

    @field_validator("size_bytes")
    @classmethod
    def _size(cls, v: int) -> int:
        return _check_size(v)

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v and v not in VOLUME_BACKENDS:
            raise ValueError(f"{quote(v)} is not a backend ({', '.join(VOLUME_BACKENDS)})")
        return v


class Volume(Model):
    spec: VolumeSpec
    state: VolumeState = VolumeState.PENDING
    node: str = ""
    backend: str = ""
    pool: str = ""
    attached_to: list[str] = Field(default_factory=list)
    message: str = ""
    workload: str = ""
    ordinal: int = 0
    created_by: str = ""
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    etag: str = Field(default_factory=new_workload_etag)

    @property
    def name(self) -> str:
        return self.spec.name


class VolumeAttachment(Model):
    """One volume as an instance uses it (see proto VolumeAttachment)."""

    model_config = ConfigDict(frozen=True)

    name: str
    size_bytes: int
    backend: str
    node: str = ""
    pool: str = ""
    mount_path: str = ""
    read_only: bool = False
    env_name: str = ""


class VolumeReport(Model):
    """A volume as its agent reports it (see proto VolumeStatus)."""

    name: str
    state: VolumeState
    size_bytes: int = 0
    backend: str = ""
    message: str = ""
    attached_to: list[str] = Field(default_factory=list)


class ClassCount(Model):
    class_name: str
    count: int


class Pool(Model):
    name: str
    node_count: int = 0
    ready_node_count: int = 0
    capacity: Resources = Field(default_factory=Resources)
    allocatable: Resources = Field(default_factory=Resources)
    allocated: Resources = Field(default_factory=Resources)
    available_classes: list[ClassCount] = Field(default_factory=list)
    volume_capacity_bytes: int = 0
    volume_backends: list[str] = Field(default_factory=list)
