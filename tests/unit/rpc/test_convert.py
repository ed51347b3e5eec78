"""Protobuf <-> domain conversion: validation errors become Invalid naming `spec.<field>`."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import MORE_VIOLATIONS, FieldViolation, Invalid
from orka.models import (
    HealthState,
    Instance,
    InstancePhase,
    InstanceReport,
    Node,
    NodeState,
    PortBinding,
    PortProtocol,
    PortSpec,
    Resources,
    RestartPolicy,
    VmSpec,
    Workload,
    WorkloadKind,
    WorkloadSpec,
    WorkloadStatus,
)
from orka.rpc import convert


def spec_pb(**overrides: Any) -> pb.WorkloadSpec:
    fields: dict[str, Any] = {
        "name": "web",
        "kind": pb.WorkloadSpec.PROCESS,
        "command": ["sleep", "10"],
        "replicas": 2,
    }
    fields.update(overrides)
    return pb.WorkloadSpec(**fields)


def spec(**overrides: Any) -> WorkloadSpec:
    fields: dict[str, Any] = {"name": "web", "kind": WorkloadKind.PROCESS, "command": ["x"]}
    fields.update(overrides)
    return WorkloadSpec(**fields)


def test_kind_unspecified_is_invalid() -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(kind=pb.WorkloadSpec.KIND_UNSPECIFIED))
    assert info.value.message.startswith("spec.kind")


def test_unknown_kind_is_invalid() -> None:
    with pytest.raises(Invalid, match=r"^spec\.kind: "):
        convert.spec_from_pb(spec_pb(kind=42))


def test_unknown_restart_policy_is_invalid() -> None:
    # Regression: an unknown enum value used to escape as a bare ValueError.
    with pytest.raises(Invalid, match=r"^spec\.restart_policy: unknown policy 42"):
        convert.spec_from_pb(spec_pb(restart_policy=42))


@pytest.mark.parametrize(
    ("value", "policy"),
    [
        (pb.WorkloadSpec.RESTART_POLICY_UNSPECIFIED, RestartPolicy.ALWAYS),
        (pb.WorkloadSpec.ALWAYS, RestartPolicy.ALWAYS),
        (pb.WorkloadSpec.ON_FAILURE, RestartPolicy.ON_FAILURE),
        (pb.WorkloadSpec.NEVER, RestartPolicy.NEVER),
    ],
)
def test_restart_policy_mapping(value: int, policy: RestartPolicy) -> None:
    assert convert.spec_from_pb(spec_pb(restart_policy=value)).restart_policy is policy


def test_defaults_from_empty_fields() -> None:
    s = convert.spec_from_pb(spec_pb())
    assert s.stop_grace_seconds == 10.0  # unset optional keeps the model default
    assert s.vm is None
    assert s.resources == Resources()
    assert s.kind is WorkloadKind.PROCESS


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        ({"name": ""}, "spec.name", "required"),
        ({"name": "Web"}, "spec.name", "lowercase"),
        ({"name": "x" * 64}, "spec.name", "1-63"),
        ({"replicas": -1}, "spec.replicas", "greater than or equal to 0"),
        ({"replicas": 1001}, "spec.replicas", "less than or equal to 1000"),
        ({"resources": pb.Resources(cpu_millis=-1)}, "spec.resources.cpu_millis", "greater"),
        ({"resources": pb.Resources(memory_bytes=-1)}, "spec.resources.memory_bytes", "greater"),
        ({"env": {"A=B": "1"}}, "spec.env['A=B'] (key)", "'='"),
        ({"node_selector": {"bad key": "1"}}, "spec.node_selector['bad key'] (key)", "label key"),
        ({"stop_grace_period": Duration(seconds=-1)}, "spec.stop_grace_period", "between 0s"),
        ({"stop_grace_period": Duration(seconds=4000)}, "spec.stop_grace_period", "3600s"),
        (
            {"stop_grace_period": Duration(seconds=1, nanos=-5)},
            "spec.stop_grace_period",
            "not a valid Duration",
        ),
        ({"max_per_node": -2}, "spec.max_per_node", "greater"),
        ({"command": []}, "spec", "command is required for a PROCESS"),
        ({"kind": pb.WorkloadSpec.CONTAINER}, "spec", "image is required"),
        ({"kind": pb.WorkloadSpec.VM, "vm": pb.VmSpec(initrd="/i")}, "spec", "vm.kernel"),
    ],
)
def test_validation_error_becomes_invalid_naming_field(
    overrides: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(**overrides))
    message = info.value.message
    assert message.startswith(f"{field}: ")
    assert fragment in message
    assert "Value error," not in message
    # The same field and reason as a google.rpc.BadRequest violation.
    assert info.value.fields == [FieldViolation(field, message.removeprefix(f"{field}: "))]


def test_several_errors_are_all_named() -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(name="BAD", replicas=-1))
    parts = info.value.message.split("; ")
    assert [p.split(":")[0] for p in parts] == ["spec.name", "spec.replicas"]
    assert [str(v) for v in info.value.fields] == parts
    assert MORE_VIOLATIONS not in info.value.metadata


def test_past_five_errors_the_rest_are_counted() -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(command=[f"a\0{i}" for i in range(8)]))
    assert [v.field for v in info.value.fields] == [f"spec.command[{i}]" for i in range(5)]
    assert info.value.message.endswith("; and 3 more")
    assert info.value.metadata == {MORE_VIOLATIONS: "3"}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kind": pb.WorkloadSpec.KIND_UNSPECIFIED}, "spec.kind"),
        ({"kind": 42}, "spec.kind"),
        ({"restart_policy": 42}, "spec.restart_policy"),
        ({"env": {"K": "v" * (2 << 20)}}, "spec.env"),
    ],
)
def test_checks_before_the_model_name_their_field_too(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(**overrides))
    assert [v.field for v in info.value.fields] == [field]
    assert info.value.message == str(info.value.fields[0])


SPECS = [
    spec(),
    spec(
        image="img",
        command=["a", "b"],
        env={"A": "1", "B": ""},
        replicas=7,
        resources=Resources(cpu_millis=250, memory_bytes=1 << 20),
        node_selector={"zone": "eu"},
        restart_policy=RestartPolicy.NEVER,
        working_dir="/srv",
        max_per_node=2,
        stop_grace_seconds=2.5,
    ),
    spec(kind=WorkloadKind.CONTAINER, command=[], image="nginx:1", replicas=0),
    spec(
        kind=WorkloadKind.VM,
        command=[],
        vm=VmSpec(kernel="/k", initrd="/i", cmdline="console=ttyS0"),
        restart_policy=RestartPolicy.ON_FAILURE,
    ),
    spec(kind=WorkloadKind.VM, command=[], image="/disk.qcow2", stop_grace_seconds=0),
]


@pytest.mark.parametrize("s", SPECS)
def test_spec_round_trip(s: WorkloadSpec) -> None:
    msg = convert.spec_to_pb(s)
    assert convert.spec_from_pb(msg) == s
    # And the wire form is stable too.
    assert convert.spec_to_pb(convert.spec_from_pb(msg)) == msg


def test_workload_round_trip() -> None:
    w = Workload(
        spec=SPECS[1],
        generation=3,
        deleting=True,
        created_at=100.5,
        updated_at=200.25,
        status=WorkloadStatus(
            desired=7, placed=5, running=4, unschedulable_reasons=["r1", "r2"], message="m"
        ),
    )
    assert convert.workload_from_pb(convert.workload_to_pb(w)) == w


INSTANCES = [
    Instance(name="web-1", workload="web", created_at=1.0, updated_at=2.0),
    Instance(
        name="web-2",
        workload="web",
        generation=4,
        node="n1",
        phase=InstancePhase.FAILED,
        reason="Crashed",
        message="exit 0",
        exit_code=0,  # zero must survive (optional field)
        restarts=3,
        created_at=1.0,
        updated_at=5.0,
        scheduled_at=2.0,
        started_at=3.0,
        finished_at=4.0,
    ),
    Instance(
        name="web-3",
        workload="web",
        phase=InstancePhase.LOST,
        exit_code=-9,
        created_at=1.0,
        updated_at=1795000000.25,
        ordinal=7,  # which replica (and template volume) it is
    ),
]


def test_times_are_timestamps_and_the_grace_period_a_duration_in_json() -> None:
    w = Workload(spec=SPECS[1], created_at=1795000000.125, updated_at=1795000060.5)
    shown = json_format.MessageToDict(convert.workload_to_pb(w))
    assert shown["createTime"] == "2026-11-18T11:06:40.125Z"
    assert shown["updateTime"] == "2026-11-18T11:07:40.500Z"
    assert shown["spec"]["stopGracePeriod"] == "2.500s"
    assert shown["etag"] == w.etag
    assert "createdAt" not in shown and "stopGraceSeconds" not in shown["spec"]


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (1795000000.123456, "2026-11-18T11:06:40.123456Z"),
        (1795000000.1234564, "2026-11-18T11:06:40.123456Z"),
        (1795000000.9999996, "2026-11-18T11:06:41Z"),
        (1.5, "1970-01-01T00:00:01.500Z"),
        (4102444799.999999, "2099-12-31T23:59:59.999999Z"),
    ],
)
def test_a_time_is_kept_to_the_microsecond(seconds: float, shown: str) -> None:
    msg = convert.instance_to_pb(Instance(name="a", workload="w", created_at=seconds))
    assert msg.create_time.ToJsonString() == shown
    back = convert.instance_from_pb(msg).created_at
    assert abs(back - seconds) < 1e-6
    # And from there on it stays put: a time read back and sent again is the same time.
    again = convert.instance_to_pb(Instance(name="a", workload="w", created_at=back))
    assert again.create_time == msg.create_time


def test_a_time_not_yet_reached_stays_unset() -> None:
    msg = convert.instance_to_pb(INSTANCES[0])
    assert msg.HasField("create_time")
    assert not msg.HasField("schedule_time")
    assert not msg.HasField("start_time")
    assert not msg.HasField("end_time")
    assert "startTime" not in json_format.MessageToDict(msg)


def test_node_shows_its_instance_count_heartbeat_time_and_etag() -> None:
    n = Node(name="n1", instance_count=3, last_heartbeat=1795000000.0, schedulable=False)
    msg = convert.node_to_pb(n)
    assert msg.instance_count == 3
    assert msg.last_heartbeat_time.ToJsonString() == "2026-11-18T11:06:40Z"
    back = convert.node_from_pb(msg)
    assert (back.instance_count, back.last_heartbeat) == (3, 1795000000.0)
    # The etag follows what users write of a node, not its heartbeats or usage.
    busy = n.model_copy(update={"last_heartbeat": 1795000001.0, "instance_count": 4})
    assert convert.node_to_pb(busy).etag == msg.etag
    assert convert.node_to_pb(n.model_copy(update={"schedulable": True})).etag != msg.etag
    assert convert.node_to_pb(n.model_copy(update={"draining": True})).etag != msg.etag


def test_node_leaving_round_trips_apart_from_draining() -> None:
    """A leave is the scheduler's soft state, not a user's write: its own field, and the
    node's etag does not move with it."""
    n = Node(name="n1")
    leaving = convert.node_to_pb(n.model_copy(update={"leaving": True}))
    assert (leaving.leaving, leaving.draining, leaving.schedulable) == (True, False, True)
    back = convert.node_from_pb(leaving)
    assert (back.leaving, back.draining) == (True, False)
    assert leaving.etag == convert.node_to_pb(n).etag


@pytest.mark.parametrize("inst", INSTANCES)
def test_instance_round_trip(inst: Instance) -> None:
    back = convert.instance_from_pb(convert.instance_to_pb(inst))
    assert back == inst
    assert back.exit_code == inst.exit_code
    assert back.phase is inst.phase


def test_instance_controller_only_fields_are_not_on_the_wire() -> None:
    inst = INSTANCES[1].model_copy(update={"desired_stop": True, "replaced_by": "web-9"})
    back = convert.instance_from_pb(convert.instance_to_pb(inst))
    assert (back.desired_stop, back.replaced_by) == (False, "")


def test_instance_phase_unspecified_is_invalid() -> None:
    with pytest.raises(Invalid, match="phase"):
        convert.instance_from_pb(pb.Instance(name="x", workload="w"))


@pytest.mark.parametrize("state", list(NodeState))
def test_node_round_trip(state: NodeState) -> None:
    n = Node(
        name="n1",
        state=state,
        schedulable=False,
        draining=True,
        capacity=Resources(cpu_millis=4000, memory_bytes=8),
        allocatable=Resources(cpu_millis=3900, memory_bytes=7),
        allocated=Resources(cpu_millis=100, memory_bytes=1),
        usage=Resources(cpu_millis=50, memory_bytes=2),
        labels={"zone": "a"},
        drivers=["fake", "process"],
        instances=3,
        last_heartbeat=123.5,
        message="hello",
    )
    back = convert.node_from_pb(convert.node_to_pb(n))
    # joined_at is controller bookkeeping, not on the wire.
    assert back.model_dump(exclude={"joined_at"}) == n.model_dump(exclude={"joined_at"})


def test_node_state_unspecified_means_ready() -> None:
    assert convert.node_from_pb(pb.Node(name="n")).state is NodeState.READY


@pytest.mark.parametrize("state", list(NodeState))
def test_node_state_each_way(state: NodeState) -> None:
    msg = pb.Node(name="n", state=pb.Node.State.Value(state.value))  # type: ignore[arg-type]
    assert convert.node_from_pb(msg).state is state


def test_node_state_unknown_is_invalid() -> None:
    with pytest.raises(Invalid, match=r"node 'n': unknown state 42") as err:
        convert.node_from_pb(pb.Node(name="n", state=42))  # type: ignore[arg-type]
    assert [v.field for v in err.value.fields] == ["state"]


@pytest.mark.parametrize("phase", list(InstancePhase))
def test_phase_each_way(phase: InstancePhase) -> None:
    assert convert.phase_from_pb(convert.phase_to_pb(phase)) is phase


@pytest.mark.parametrize(
    "report",
    [
        InstanceReport(name="a", workload="w", node="n1", phase=InstancePhase.RUNNING),
        InstanceReport(
            name="b",
            workload="w",
            node="n1",
            phase=InstancePhase.SUCCEEDED,
            reason="Completed",
            message="ok",
            exit_code=0,
            restarts=2,
            started_at=1.0,
            finished_at=2.0,
        ),
    ],
)
def test_report_round_trip(report: InstanceReport) -> None:
    msg = convert.instance_status_to_pb(report, Resources(cpu_millis=5, memory_bytes=6))
    assert msg.resources.cpu_millis == 5
    assert convert.report_from_pb(msg, "n1") == report


@pytest.mark.parametrize(
    ("msg", "fragment"),
    [
        (apb.InstanceStatus(phase=pb.Instance.RUNNING), "name is required"),
        (apb.InstanceStatus(name="a"), "phase: is required"),
        (apb.InstanceStatus(name="a", phase=99), "unknown phase"),
        (
            apb.InstanceStatus(name="n" * 100_000, phase=pb.Instance.RUNNING),
            "name and workload must be at most 253 characters",
        ),
        (
            apb.InstanceStatus(name="a", workload="w" * 254, phase=pb.Instance.RUNNING),
            "name and workload must be at most 253",
        ),
    ],
)
def test_report_from_pb_rejects_bad_input(msg: apb.InstanceStatus, fragment: str) -> None:
    with pytest.raises(Invalid) as info:
        convert.report_from_pb(msg, "n1")
    assert fragment in info.value.message
    assert len(info.value.message) < 200  # never the whole name


def test_report_from_pb_cuts_long_reasons_and_messages() -> None:
    msg = apb.InstanceStatus(
        name="a", phase=pb.Instance.FAILED, reason="R" * 1000, message="M" * 100_000
    )
    r = convert.report_from_pb(msg, "n1")
    assert (r.reason, r.message) == ("R" * 256, "M" * 4096)


def test_report_from_pb_takes_node_from_caller() -> None:
    r = convert.report_from_pb(apb.InstanceStatus(name="a", phase=pb.Instance.LOST), "trusted")
    assert r.node == "trusted"
    assert r.exit_code is None
    assert r.started_at is None


def test_readers_get_secret_values_redacted_and_agents_get_them_in_clear() -> None:
    s = spec(secret_env={"TOKEN": "t0ken-value", "DB_PASSWORD": "pw-value"}, env={"A": "1"})
    for_reader = convert.workload_to_pb(Workload(spec=s))
    assert dict(for_reader.spec.secret_env) == {"TOKEN": "<redacted>", "DB_PASSWORD": "<redacted>"}
    assert b"t0ken-value" not in for_reader.SerializeToString()
    assert b"pw-value" not in for_reader.SerializeToString()
    assert dict(for_reader.spec.env) == {"A": "1"}
    # The spec sent towards the agents (placement) carries the values.
    assert dict(convert.spec_to_pb(s).secret_env) == {
        "TOKEN": "t0ken-value",
        "DB_PASSWORD": "pw-value",
    }
    assert convert.spec_from_pb(convert.spec_to_pb(s)) == s


def test_created_by_and_updated_by_round_trip() -> None:
    w = Workload(spec=spec(), created_by="admin/admin", updated_by="admin/alice")
    msg = convert.workload_to_pb(w)
    assert (msg.created_by, msg.updated_by) == ("admin/admin", "admin/alice")
    back = convert.workload_from_pb(msg)
    assert (back.created_by, back.updated_by) == ("admin/admin", "admin/alice")


@pytest.mark.parametrize(
    ("secret_env", "expected"),
    [
        ({"": "v"}, "spec.secret_env: key '' must be 1-256 characters without '=' or NUL"),
        ({"A=B": "v"}, "spec.secret_env: key 'A=B' must be"),
        ({"K": "bad\0value"}, "spec.secret_env: the value of 'K' must be at most 65536 bytes"),
        ({"K": "v" * 65537}, "spec.secret_env: the value of 'K' must be at most 65536 bytes"),
        (
            {f"K{i}": "v" * 60000 for i in range(5)},
            "spec.secret_env: must be at most 262144 bytes in all",
        ),
        ({"A": "v"}, "spec.secret_env: 'A' is also in env; give each variable once"),
    ],
)
def test_secret_env_is_validated_without_echoing_values(
    secret_env: dict[str, str], expected: str
) -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(secret_env=secret_env, env={"A": "1"}))
    assert info.value.message.startswith(expected)
    for value in secret_env.values():
        if len(value) > 3:
            assert value not in info.value.message


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"K": "relative/path"}, "spec.secret_env_files: the path of 'K' must be absolute"),
        ({"K": "/etc/orka/../orka/x"}, "spec.secret_env_files: the path of 'K' must be absolute"),
        ({"K": "/etc//x"}, "spec.secret_env_files: the path of 'K' must be absolute"),
        ({"K": "/etc/x\0"}, "spec.secret_env_files: the path of 'K' must be absolute"),
        ({"A=": "/x"}, "spec.secret_env_files: key 'A=' must be"),
        ({f"K{i}": "/x" for i in range(65)}, "spec.secret_env_files: at most 64 files, got 65"),
        ({"A": "/x"}, "spec.secret_env_files: 'A' is also in env or secret_env"),
    ],
)
def test_secret_env_files_are_validated(files: dict[str, str], expected: str) -> None:
    with pytest.raises(Invalid) as info:
        convert.spec_from_pb(spec_pb(secret_env_files=files, env={"A": "1"}))
    assert info.value.message.startswith(expected)


def test_secret_env_file_paths_are_returned_as_they_are() -> None:
    s = spec(secret_env_files={"DB": "/etc/orka/secrets/db"})
    assert dict(convert.workload_to_pb(Workload(spec=s)).spec.secret_env_files) == {
        "DB": "/etc/orka/secrets/db"
    }
    assert convert.spec_from_pb(convert.spec_to_pb(s)) == s


# ---- ports ----

WEB_PORTS = [
    PortSpec(name="http", port=8080),
    PortSpec(name="dns", port=53, host_port=5353, protocol=PortProtocol.UDP),
]


def test_spec_ports_each_way() -> None:
    spec = WorkloadSpec(name="w", kind="CONTAINER", image="busybox", ports=WEB_PORTS)
    msg = convert.spec_to_pb(spec)
    assert [(p.name, p.HasField("port"), p.host_port, p.protocol) for p in msg.ports] == [
        ("http", True, 0, pb.PortSpec.TCP),
        ("dns", True, 5353, pb.PortSpec.UDP),
    ]
    assert convert.spec_from_pb(msg) == spec
    # A host-network process leaves `port` out: unset on the wire, None in the model.
    proc = WorkloadSpec(name="p", kind="PROCESS", command=["x"], ports=[PortSpec(name="http")])
    back = convert.spec_from_pb(convert.spec_to_pb(proc))
    assert not convert.spec_to_pb(proc).ports[0].HasField("port")
    assert back.ports[0].port is None and back == proc


def test_an_unspecified_protocol_is_tcp() -> None:
    msg = pb.WorkloadSpec(
        name="w", kind=pb.WorkloadSpec.CONTAINER, image="b", ports=[pb.PortSpec(name="a", port=1)]
    )
    assert convert.spec_from_pb(msg).ports[0].protocol is PortProtocol.TCP


def test_report_carries_where_the_instance_is_reached() -> None:
    report = InstanceReport(
        name="a",
        workload="w",
        node="n1",
        phase=InstancePhase.RUNNING,
        address="10.88.0.5",
        host_ip="192.0.2.7",
        ports=[PortBinding(name="http", port=8080, host_port=20001)],
    )
    msg = convert.instance_status_to_pb(report)
    assert convert.report_from_pb(msg, "n1") == report
    inst = Instance(name="a", workload="w", phase=InstancePhase.RUNNING)
    updated = inst.reported(report, now=5.0)
    assert updated is not None
    assert (updated.address, updated.host_ip, updated.ports) == (
        "10.88.0.5",
        "192.0.2.7",
        report.ports,
    )
    back = convert.instance_from_pb(convert.instance_to_pb(updated))
    assert (back.address, back.host_ip, back.ports) == ("10.88.0.5", "192.0.2.7", report.ports)
    # Reported again unchanged: nothing to write.
    assert updated.reported(report, now=6.0) is None


def _status(**fields: object) -> apb.InstanceStatus:
    return apb.InstanceStatus(name="a", phase=pb.Instance.RUNNING, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("msg", "fragment"),
    [
        (_status(address="evil.example"), "address: 'evil.example' is not an IP address"),
        (_status(host_ip="1.2.3"), "host_ip: '1.2.3' is not an IP address"),
        (_status(address="1" * 100), "address: not an IP address (over 45 characters)"),
        (
            _status(ports=[pb.PortBinding(name="a", port=70000)]),
            "ports[0]: port and host_port must be 0-65535",
        ),
        (_status(ports=[pb.PortBinding(name="A B")]), "ports[0]: name 'A B' must be"),
        (_status(ports=[pb.PortBinding(name="a" * 16)]), "ports[0]: name must be at most 15"),
        (_status(ports=[pb.PortBinding(name="a", protocol=9)]), "ports[0].protocol: unknown"),
        (_status(ports=[pb.PortBinding(name="a")] * 33), "ports: at most 32"),
    ],
)
def test_report_from_pb_rejects_bad_addresses_and_ports(
    msg: apb.InstanceStatus, fragment: str
) -> None:
    with pytest.raises(Invalid) as info:
        convert.report_from_pb(msg, "n1")
    assert fragment in info.value.message
    assert len(info.value.message) < 200


def test_report_from_pb_normalises_addresses() -> None:
    r = convert.report_from_pb(_status(address="fd00:0::5", host_ip="127.0.0.1"), "n1")
    assert (r.address, r.host_ip) == ("fd00::5", "127.0.0.1")


def test_health_goes_from_the_agent_to_the_instance_and_back() -> None:
    report = InstanceReport(
        name="a",
        workload="w",
        phase=InstancePhase.RUNNING,
        health=HealthState.UNHEALTHY,
        health_message="GET /healthz: status 503",
        health_changed_at=1700000000.5,
    )
    msg = convert.instance_status_to_pb(report)
    assert msg.health == pb.Instance.UNHEALTHY
    got = convert.report_from_pb(msg, "n1")
    assert (got.health, got.health_message, got.health_changed_at) == (
        HealthState.UNHEALTHY,
        "GET /healthz: status 503",
        1700000000.5,
    )
    inst = Instance(name="a", workload="w", phase=InstancePhase.RUNNING)
    updated = inst.reported(got, now=5.0)
    assert updated is not None
    back = convert.instance_from_pb(convert.instance_to_pb(updated))
    assert (back.health, back.health_message, back.health_changed_at) == (
        HealthState.UNHEALTHY,
        "GET /healthz: status 503",
        1700000000.5,
    )
    # An agent that says nothing of health (an older one, or a stopped instance): UNKNOWN.
    quiet = convert.report_from_pb(apb.InstanceStatus(name="a", phase=pb.Instance.RUNNING), "n")
    assert quiet.health is HealthState.UNKNOWN
    with pytest.raises(Invalid, match="instance status a: health: unknown health 9"):
        convert.report_from_pb(
            apb.InstanceStatus(name="a", phase=pb.Instance.RUNNING, health=9), "n"
        )
