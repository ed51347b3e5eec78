"""The spec's `health_check`: validation with a field violation per bad field (model, wire and
manifest), its round trip through the API's messages, and the manifest's keys."""

from __future__ import annotations

import pytest
from google.protobuf.duration_pb2 import Duration

from orka.api import controller_pb2 as pb
from orka.cli.manifest import parse_manifests
from orka.errors import FieldViolation, Invalid
from orka.models import HealthCheck, WorkloadSpec
from orka.rpc.convert import spec_from_pb, spec_to_pb


def wire(check: pb.HealthCheck, kind: int = pb.WorkloadSpec.PROCESS) -> pb.WorkloadSpec:
    msg = pb.WorkloadSpec(name="a", kind=kind, ports=[pb.PortSpec(name="web")])
    if kind == pb.WorkloadSpec.PROCESS:
        msg.command.append("x")
    else:
        msg.image = "/srv/disk.qcow2" if kind == pb.WorkloadSpec.VM else "busybox"
        msg.ports[0].port = 80
    msg.health_check.CopyFrom(check)
    return msg


@pytest.mark.parametrize(
    ("check", "kind", "field", "description"),
    [
        (
            pb.HealthCheck(http=pb.HealthCheck.Http(port="api")),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.http.port",
            "no port named 'api'",
        ),
        (
            pb.HealthCheck(tcp=pb.HealthCheck.Tcp(port="70000")),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.tcp.port",
            "70000 is not a port (1-65535)",
        ),
        (
            pb.HealthCheck(tcp=pb.HealthCheck.Tcp()),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.tcp.port",
            "is required (a port's name or number)",
        ),
        (
            pb.HealthCheck(
                tcp=pb.HealthCheck.Tcp(port="web"),
                interval=Duration(seconds=1),
                timeout=Duration(seconds=2),
            ),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.timeout",
            "2s is longer than the interval (1s)",
        ),
        (
            pb.HealthCheck(tcp=pb.HealthCheck.Tcp(port="web"), interval=Duration(seconds=7200)),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.interval",
            "Input should be less than or equal to 3600",
        ),
        (
            pb.HealthCheck(tcp=pb.HealthCheck.Tcp(port="web"), failure_threshold=101),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.failure_threshold",
            "Input should be less than or equal to 100",
        ),
        (
            pb.HealthCheck(tcp=pb.HealthCheck.Tcp(port="web"), success_threshold=-1),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.success_threshold",
            "Input should be greater than or equal to 1",
        ),
        (
            pb.HealthCheck(http=pb.HealthCheck.Http(port="web", path="healthz")),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.http.path",
            "must start with '/' and be at most 1024 printable ASCII characters without spaces",
        ),
        (
            pb.HealthCheck(http=pb.HealthCheck.Http(port="web", status_min=300, status_max=200)),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.http.status_min",
            "300 is above status_max 200",
        ),
        (
            pb.HealthCheck(interval=Duration(seconds=5)),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check",
            "give exactly one of exec, tcp or http",
        ),
        (
            pb.HealthCheck(exec=pb.HealthCheck.Exec(command=["true"])),
            pb.WorkloadSpec.VM,
            "spec.health_check.exec",
            "exec checks are for PROCESS and CONTAINER workloads; use tcp or http for a VM",
        ),
        (
            pb.HealthCheck(exec=pb.HealthCheck.Exec()),
            pb.WorkloadSpec.PROCESS,
            "spec.health_check.exec.command",
            "List should have at least 1 item after validation, not 0",
        ),
    ],
)
def test_a_bad_check_is_refused_naming_the_field(
    check: pb.HealthCheck, kind: int, field: str, description: str
) -> None:
    with pytest.raises(Invalid) as err:
        spec_from_pb(wire(check, kind))
    assert err.value.fields == [FieldViolation(field, description)]


def test_a_container_may_have_an_exec_check() -> None:
    check = pb.HealthCheck(exec=pb.HealthCheck.Exec(command=["cat", "/etc/hostname"]))
    parsed = spec_from_pb(wire(check, pb.WorkloadSpec.CONTAINER)).health_check
    assert parsed is not None and parsed.exec is not None
    assert parsed.exec.command == ["cat", "/etc/hostname"]


def test_a_udp_port_cannot_be_checked() -> None:
    msg = wire(pb.HealthCheck(tcp=pb.HealthCheck.Tcp(port="dns")))
    msg.ports.append(pb.PortSpec(name="dns", protocol=pb.PortSpec.UDP))
    with pytest.raises(Invalid) as err:
        spec_from_pb(msg)
    assert err.value.fields == [
        FieldViolation("spec.health_check.tcp.port", "'dns' is udp; a tcp check needs a tcp port")
    ]


def test_defaults_and_the_round_trip() -> None:
    parsed = spec_from_pb(wire(pb.HealthCheck(tcp=pb.HealthCheck.Tcp(port="web"))))
    assert parsed.health_check == HealthCheck(tcp={"port": "web"})
    check = parsed.health_check
    assert check is not None
    assert (check.interval, check.timeout, check.initial_delay) == (10.0, 2.0, 0.0)
    assert (check.failure_threshold, check.success_threshold) == (3, 1)
    full = WorkloadSpec.model_validate(
        {
            "name": "a",
            "kind": "PROCESS",
            "command": ["x"],
            "ports": [{"name": "web"}],
            "health_check": {
                "http": {"port": 8080, "path": "/healthz", "status_max": 299},
                "interval": 2.5,
                "timeout": 0.25,
                "initial_delay": 30,
                "failure_threshold": 5,
                "success_threshold": 2,
            },
        }
    )
    msg = spec_to_pb(full)
    assert msg.health_check.interval == Duration(seconds=2, nanos=500_000_000)
    assert msg.health_check.http.port == "8080"
    assert spec_from_pb(msg) == full
    exec_check = spec_from_pb(wire(pb.HealthCheck(exec=pb.HealthCheck.Exec(command=["a", "b"]))))
    assert spec_from_pb(spec_to_pb(exec_check)) == exec_check


def test_manifest_keys_in_either_case_and_spans_as_durations_or_seconds() -> None:
    (parsed,) = parse_manifests(
        """
name: a
kind: process
command: [x]
ports: [{name: web}]
healthCheck:
  http: {port: web, path: /ok, statusMax: 299}
  interval: 2s
  timeout: 1
  initialDelay: 500ms
  failure_threshold: 2
"""
    )
    assert parsed.health_check == HealthCheck(
        http={"port": "web", "path": "/ok", "status_max": 299},
        interval=2,
        timeout=1,
        initial_delay=0.5,
        failure_threshold=2,
    )
    (parsed,) = parse_manifests(
        "name: a\nkind: process\ncommand: [x]\nhealth_check: {exec: {command: 'test -e ok'}}\n"
    )
    assert parsed.health_check is not None and parsed.health_check.exec is not None
    assert parsed.health_check.exec.command == ["test", "-e", "ok"]


@pytest.mark.parametrize(
    ("check", "message"),
    [
        ("{tcp: {port: web}, every: 5s}", "health_check: unknown key 'every'"),
        ("{tcp: {port: web, host: x}}", "health_check.tcp: unknown key 'host'"),
        ("{tcp: {port: web}, interval: soon}", "health_check.interval: 'soon' is not a duration"),
        ("{http: {port: api}}", "health_check.http.port: no port named 'api'"),
    ],
)
def test_manifest_errors_name_the_key(check: str, message: str) -> None:
    text = f"name: a\nkind: process\ncommand: [x]\nports: [{{name: web}}]\nhealthCheck: {check}\n"
    with pytest.raises(Invalid) as err:
        parse_manifests(text)
    assert message in err.value.message
