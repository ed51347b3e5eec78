"""Rendering: aligned tables like kubectl, and json/yaml straight from the pydantic models."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import time
from collections.abc import Iterable, Sequence

import yaml
from pydantic import BaseModel

from orka.cli.client import Activity
from orka.cli.units import format_cpu, format_duration, format_memory
from orka.etags import node_etag
from orka.models import (
    Endpoint,
    HealthCheck,
    Instance,
    Node,
    OnNodeLost,
    PortBinding,
    PortProtocol,
    Resources,
    RolloutState,
    Workload,
    WorkloadSpec,
)

FORMATS = ("table", "json", "yaml")
_GAP = "   "
NONE = "<none>"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [_GAP.join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    # The last column is padded too; trailing blanks would only upset diffs and copy-paste.
    return "\n".join(line.rstrip() for line in lines)


def age(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return NONE
    seconds = max(0, int((now if now is not None else time.time()) - ts))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 3600:
        m, s = divmod(seconds, 60)
        return f"{m}m{s}s" if m < 10 and s else f"{m}m"
    if seconds < 48 * 3600:
        h, rest = divmod(seconds, 3600)
        m = rest // 60
        return f"{h}h{m}m" if h < 10 and m else f"{h}h"
    return f"{seconds // 86400}d"


def timestamp(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return NONE
    when = dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{when} ({age(ts, now)} ago)"


def resources(r: Resources) -> str:
    return f"cpu {format_cpu(r.cpu_millis)}, memory {format_memory(r.memory_bytes)}"


def mapping(m: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(m.items())) or NONE


# The models hold times as float Unix seconds; json/yaml output shows them as the API does
# (AIP-142 names, RFC 3339), so a script reads the same shape from `orka get -o json` as from
# grpcurl.
_TIME_FIELDS = {
    "created_at": "create_time",
    "updated_at": "update_time",
    "scheduled_at": "schedule_time",
    "started_at": "start_time",
    "finished_at": "end_time",
    "last_heartbeat": "last_heartbeat_time",
    "joined_at": "join_time",
    "health_changed_at": "health_time",
    "disconnected_at": "disconnect_time",
    "first_at": "first_time",
    "progress_at": "progress_time",
    "deadline": "deadline_time",
    "last_at": "last_time",
}
# A health check's spans, shown as the API's Durations (`10s`) as the grace period is.
_CHECK_SPANS = ("interval", "timeout", "initial_delay")


def rfc3339(ts: float | None) -> str | None:
    if not ts:
        return None
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def _api_shape(plain: object) -> object:
    if isinstance(plain, list):
        return [_api_shape(v) for v in plain]
    if not isinstance(plain, dict):
        return plain
    out: dict[str, object] = {}
    for key, value in plain.items():
        if key in _TIME_FIELDS:
            out[_TIME_FIELDS[key]] = rfc3339(value)
        elif key == "stop_grace_seconds":
            out["stop_grace_period"] = format_duration(value)
        elif key == "max_disconnect":
            if value:
                out[key] = format_duration(value)
        elif key == "health_check" and isinstance(value, dict):
            check = {k: v for k, v in value.items() if v is not None}
            out[key] = {k: format_duration(v) if k in _CHECK_SPANS else v for k, v in check.items()}
        else:
            out[key] = _api_shape(value)
    return out


def _plain(model: BaseModel) -> object:
    plain = model.model_dump(mode="json")
    if isinstance(model, Node):
        # Derived, not stored (orka/etags.py); shown so that `--etag` can be given it.
        plain["etag"] = node_etag(model)
    if isinstance(model, Workload):
        plain.pop("revisions", None)  # not on the wire: `orka rollout history` lists them
    return _api_shape(plain)


def dump(data: BaseModel | Sequence[BaseModel], fmt: str) -> str:
    plain = _plain(data) if isinstance(data, BaseModel) else [_plain(m) for m in data]
    if fmt == "json":
        return json.dumps(plain, indent=2)
    return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False).rstrip("\n")


WORKLOAD_HEADERS = ("NAME", "KIND", "DESIRED", "PLACED", "RUNNING", "HEALTHY", "AGE")


def workload_row(w: Workload, now: float | None = None) -> tuple[object, ...]:
    return (
        w.name + (" (deleting)" if w.deleting else ""),
        w.spec.kind.value,
        w.spec.replicas,
        w.status.placed,
        w.status.running,
        w.status.healthy,
        age(w.created_at, now),
    )


def workloads_table(items: Sequence[Workload], now: float | None = None) -> str:
    return table(WORKLOAD_HEADERS, [workload_row(w, now) for w in items])


def port_text(b: PortBinding) -> str:
    """Like docker ps: `20001->8080` (host port -> the instance's own), `20001` when they are
    one (a host-network process), `/udp` for UDP."""
    text = f"{b.host_port}->{b.port}" if b.port and b.port != b.host_port else f"{b.host_port}"
    return text + ("/udp" if b.protocol is PortProtocol.UDP else "")


def ports_text(ports: Sequence[PortBinding]) -> str:
    return ",".join(port_text(b) for b in ports) or NONE


INSTANCE_HEADERS = (
    "NAME",
    "WORKLOAD",
    "NODE",
    "PHASE",
    "ADDRESS",
    "PORTS",
    "HEALTH",
    "RESTARTS",
    "AGE",
    "MESSAGE",
)


def instance_row(i: Instance, now: float | None = None) -> tuple[object, ...]:
    return (
        i.name,
        i.workload,
        i.node or NONE,
        i.phase.value,
        i.address or NONE,
        ports_text(i.ports),
        i.health.value,
        i.restarts,
        age(i.created_at, now),
        _one_line(i.message or i.reason),
    )


def instances_table(items: Sequence[Instance], now: float | None = None) -> str:
    return table(INSTANCE_HEADERS, [instance_row(i, now) for i in items])


def endpoints_table(items: Sequence[Endpoint]) -> str:
    rows = [
        (e.instance, e.node, e.address or NONE, e.host_ip or NONE, ports_text(e.ports))
        for e in items
    ]
    return table(("INSTANCE", "NODE", "ADDRESS", "HOST IP", "PORTS"), rows)


def schedulable(n: Node) -> str:
    if n.draining:
        return "false (draining)"
    if n.leaving and n.schedulable:
        return "false (leaving)"  # its agent is stopping; not kept once it registers again
    return "true" if n.schedulable else "false (cordoned)"


NODE_HEADERS = ("NAME", "STATE", "SCHEDULABLE", "CPU", "MEMORY", "INSTANCES", "DRIVERS")


def node_row(n: Node, now: float | None = None) -> tuple[object, ...]:
    return (
        n.name,
        n.state.value,
        schedulable(n),
        f"{format_cpu(n.allocated.cpu_millis)}/{format_cpu(n.allocatable.cpu_millis)}",
        f"{format_memory(n.allocated.memory_bytes)}/{format_memory(n.allocatable.memory_bytes)}",
        n.instance_count,
        ",".join(n.drivers) or NONE,
    )


def nodes_table(items: Sequence[Node]) -> str:
    return table(NODE_HEADERS, [node_row(n) for n in items])


# ---- get -w: the list as a table, then one row (or document) per change ----

_WATCHED = {
    "workloads": (WORKLOAD_HEADERS, workload_row),
    "instances": (INSTANCE_HEADERS, instance_row),
    "nodes": (NODE_HEADERS, node_row),
}


class WatchPrinter:
    """What `orka get KIND -w` prints, like `kubectl get -w`: the listed objects as a table,
    then each change as one more row aligned to that table's columns, without repeating the
    header (json/yaml: one document per change, yaml documents separated by `---`).

    `events` (`--output-watch-events`) adds an EVENT column (ADDED, MODIFIED, DELETED; a
    listed object is ADDED) and wraps each json/yaml document as {type, object}, so that a
    deletion can be told from a change.
    """

    def __init__(self, kind: str, fmt: str, events: bool = False) -> None:
        self.headers, self._row = _WATCHED[kind]
        if events:
            self.headers = ("EVENT", *self.headers)
        self.fmt = fmt
        self.events = events
        self.widths: list[int] = [len(h) for h in self.headers]
        self.documents = 0

    def _cells(self, obj: BaseModel, type_: str, now: float | None) -> list[str]:
        row = self._row(obj, now)  # type: ignore[arg-type]
        return [str(c) for c in ((type_, *row) if self.events else row)]

    def listed(self, items: Sequence[BaseModel], now: float | None = None) -> str:
        """The first print: a table with its header (kept even when empty, so that the rows
        that follow have one), or the documents."""
        if self.fmt != "table":
            return "\n".join(self.change(obj, "ADDED") for obj in items)
        rows = [self._cells(obj, "ADDED", now) for obj in items]
        for row in rows:
            self.widths = [max(w, len(c)) for w, c in zip(self.widths, row, strict=True)]
        return "\n".join(self._line(r) for r in [list(self.headers), *rows])

    def change(self, obj: BaseModel, type_: str, now: float | None = None) -> str:
        if self.fmt == "table":
            return self._line(self._cells(obj, type_, now))
        doc: object = _plain(obj)
        if self.events:
            doc = {"type": type_, "object": doc}
        if self.fmt == "json":
            return json.dumps(doc, indent=2)
        text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).rstrip("\n")
        self.documents += 1
        return text if self.documents == 1 else "---\n" + text

    def _line(self, cells: Sequence[str]) -> str:
        # A wider cell than the first table had just pushes its row out, as kubectl's does.
        return _GAP.join(c.ljust(w) for c, w in zip(cells, self.widths, strict=True)).rstrip()


def _one_line(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def fields(pairs: Sequence[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in pairs) + 2
    return "\n".join(f"{(k + ':').ljust(width)}{v}" for k, v in pairs)


def describe_workload(w: Workload, instances: Sequence[Instance], now: float | None = None) -> str:
    s = w.spec
    pairs: list[tuple[str, object]] = [
        ("Name", s.name),
        ("Kind", s.kind.value),
    ]
    if s.image:
        pairs.append(("Image", s.image))
    if s.vm is not None:
        pairs.append(("VM", f"kernel={s.vm.kernel} initrd={s.vm.initrd} cmdline={s.vm.cmdline}"))
    pairs += [
        ("Command", shlex.join(s.command) if s.command else NONE),
        ("Replicas", s.replicas),
        ("Resources", resources(s.resources) + " per replica"),
        ("Env", mapping(s.env)),
        # The API never returns secret values; the keys are worth showing.
        ("Secret env", ",".join(sorted(s.secret_env)) or NONE),
        ("Node selector", mapping(s.node_selector)),
        ("Restart policy", s.restart_policy.value),
        ("Max per node", s.max_per_node or "no limit"),
        ("Stop grace", format_duration(s.stop_grace_seconds)),
        ("Health check", health_check_text(s.health_check)),
        ("On node lost", _on_node_lost_text(s)),
    ]
    if s.working_dir:
        pairs.append(("Working dir", s.working_dir))
    if s.user or s.group:
        group = f":{s.group}" if s.group else ""
        pairs.append(("User", f"{s.user or '(node default)'}{group}"))
    if s.secret_env_files:
        pairs.append(("Secret env files", mapping(s.secret_env_files)))
    pairs += [
        ("Generation", w.generation),
        ("Etag", w.etag),
        ("Created", timestamp(w.created_at, now)),
        ("Created by", w.created_by or NONE),
        ("Updated", timestamp(w.updated_at, now)),
        ("Updated by", w.updated_by or NONE),
        (
            "Status",
            f"desired {w.status.desired}, placed {w.status.placed}, running {w.status.running},"
            f" healthy {w.status.healthy}" + (" (deleting)" if w.deleting else ""),
        ),
    ]
    if w.status.message:
        pairs.append(("Message", w.status.message))
    r = w.rollout
    rollout = f"{r.state.value} (revision {r.revision}), updated {w.status.updated}, ready"
    rollout += f" {w.status.ready}"
    if r.rollback_of and r.state is RolloutState.PROGRESSING:
        rollout += f", rolling back revision {r.rollback_of}"
    pairs.append(("Rollout", rollout + (f": {r.message}" if r.message else "")))
    out = [fields(pairs)]
    if w.status.unschedulable_reasons:
        out.append("Unschedulable:")
        out += [f"  {r}" for r in w.status.unschedulable_reasons]
    else:
        out.append(f"Unschedulable:  {NONE}")
    out.append(_section("Instances", instances_table(instances, now) if instances else ""))
    return "\n".join(out)


def _on_node_lost_text(s: WorkloadSpec) -> str:
    if s.on_node_lost is OnNodeLost.WAIT:
        return f"wait up to {format_duration(s.max_disconnect)}, then replace"
    return "replace"


def health_check_text(check: HealthCheck | None) -> str:
    """One line: `http GET /healthz on web every 10s (timeout 2s, after 0s; unhealthy after
    3 failures, healthy after 1 success)`."""
    if check is None:
        return NONE
    if check.exec is not None:
        what = f"exec {shlex.join(check.exec.command)}"
    elif check.http is not None:
        h = check.http
        what = f"http GET {h.path} on {h.port} (status {h.status_min}-{h.status_max})"
    else:
        what = f"tcp connect to {check.port}"
    return (
        f"{what} every {format_duration(check.interval)} (timeout"
        f" {format_duration(check.timeout)}, first after {format_duration(check.initial_delay)};"
        f" unhealthy after {check.failure_threshold} failures, healthy after"
        f" {check.success_threshold} successes)"
    )


def describe_instance(i: Instance, now: float | None = None) -> str:
    since = i.health_changed_at
    pairs: list[tuple[str, object]] = [
        ("Name", i.name),
        ("Workload", i.workload),
        ("Generation", i.generation),
        ("Node", i.node or NONE),
        ("Phase", i.phase.value),
        ("Reason", i.reason or NONE),
        ("Message", i.message or NONE),
        ("Exit code", NONE if i.exit_code is None else i.exit_code),
        ("Restarts", i.restarts),
        ("Health", i.health.value + (f" for {age(i.health_changed_at, now)}" * bool(since))),
        ("Last failure", i.health_message or NONE),
        ("Created", timestamp(i.created_at, now)),
        ("Scheduled", timestamp(i.scheduled_at, now)),
        ("Started", timestamp(i.started_at, now)),
        ("Finished", timestamp(i.finished_at, now)),
        ("Address", i.address or NONE),
        ("Host IP", i.host_ip or NONE),
    ]
    if i.disconnected_at is not None:
        pairs.insert(4, ("Disconnected", timestamp(i.disconnected_at, now)))
    out = fields(pairs)
    if not i.ports:
        return out + f"\nPorts:  {NONE}"
    rows = [(b.name, b.port or NONE, b.host_port, b.protocol.value) for b in i.ports]
    return out + "\n" + _section("Ports", table(("NAME", "PORT", "HOST PORT", "PROTOCOL"), rows))


def describe_node(n: Node, instances: Sequence[Instance], now: float | None = None) -> str:
    pairs: list[tuple[str, object]] = [
        ("Name", n.name),
        ("State", n.state.value),
        ("Schedulable", schedulable(n)),
        ("Last heartbeat", timestamp(n.last_heartbeat, now)),
        ("Capacity", resources(n.capacity)),
        ("Allocatable", resources(n.allocatable)),
        ("Allocated", resources(n.allocated)),
        ("Usage", resources(n.usage)),
        ("Labels", mapping(n.labels)),
        ("Drivers", ",".join(n.drivers) or NONE),
        ("Pool", n.pool),
        ("Instances", n.instance_count),
        ("Etag", node_etag(n)),
    ]
    if n.message:
        pairs.append(("Message", n.message))
    return "\n".join(
        [
            fields(pairs),
            _section("Instances on node", instances_table(instances, now) if instances else ""),
        ]
    )


def _section(title: str, body: str) -> str:
    if not body:
        return f"{title}:  {NONE}"
    return f"{title}:\n{indent(body)}"


# ---- describe: the object's recent activity (kubectl describe's "Events:") ----


def activity_age(a: Activity, now: float | None = None) -> str:
    """'12s', or like kubectl for a repeat: '12s (x3 over 2m)'."""
    last = age(a.last_at, now)
    if a.count <= 1:
        return last
    return f"{last} (x{a.count} over {age(a.first_at, now)})"


def activity_section(items: Sequence[Activity], now: float | None = None) -> str:
    """Oldest first, as kubectl lists events; `items` come newest first from the API."""
    rows = [
        (activity_age(a, now), a.type, a.reason, _one_line(a.message, 200)) for a in reversed(items)
    ]
    body = table(("AGE", "TYPE", "REASON", "MESSAGE"), rows) if rows else ""
    return _section("Activity", body)


def describe_document(obj: BaseModel, activities: Sequence[Activity], fmt: str) -> str:
    """`orka describe -o json|yaml`: the object as `get` shows it, plus `activities` (newest
    first, as ListActivities answers)."""
    doc = _plain(obj)
    assert isinstance(doc, dict)
    doc["activities"] = [_plain(a) for a in activities]
    if fmt == "json":
        return json.dumps(doc, indent=2)
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).rstrip("\n")
