from __future__ import annotations

import json

import pytest
import yaml

from orka.cli import output
from orka.models import (
    Endpoint,
    Instance,
    InstancePhase,
    Node,
    PortBinding,
    PortProtocol,
    Resources,
    Workload,
    WorkloadSpec,
)
from orka.rpc import convert

NOW = 1_000_000.0


def workload(name: str, replicas: int = 3, running: int = 0) -> Workload:
    w = Workload(
        spec=WorkloadSpec(name=name, kind="PROCESS", command=["x"], replicas=replicas),
        created_at=NOW - 30,
    )
    w.status.running = running
    return w


def test_table_aligns_columns() -> None:
    text = output.table(("NAME", "X"), [("a", 1), ("longer-name", 22)])
    lines = text.splitlines()
    assert lines == ["NAME          X", "a             1", "longer-name   22"]
    # Every column starts at the same offset on every line.
    assert {line.index(line.split()[1]) for line in lines} == {14}


def test_workloads_table() -> None:
    text = output.workloads_table([workload("web", 3, 2), workload("a-much-longer-name", 1)], NOW)
    header, *rows = text.splitlines()
    assert header.split() == ["NAME", "KIND", "DESIRED", "PLACED", "RUNNING", "HEALTHY", "AGE"]
    assert rows[0].split() == ["web", "PROCESS", "3", "0", "2", "0", "30s"]
    assert header.index("KIND") == rows[0].index("PROCESS") == rows[1].index("PROCESS")


def test_instances_table_shows_none_for_unplaced() -> None:
    inst = Instance(name="web-1", workload="web", message="2 nodes: insufficient cpu")
    text = output.instances_table([inst], NOW)
    assert "<none>" in text and "PENDING" in text and "insufficient cpu" in text


def test_nodes_table() -> None:
    node = Node(
        name="node-1",
        allocatable=Resources(cpu_millis=4000, memory_bytes=2**33),
        allocated=Resources(cpu_millis=1500, memory_bytes=2**30),
        drivers=["process", "fake"],
        schedulable=False,
    )
    row = output.nodes_table([node]).splitlines()[1].split()
    assert row[:3] == ["node-1", "READY", "false"]
    assert "1500m/4" in row and "1Gi/8Gi" in row and "process,fake" in row


def test_json_and_yaml_dump_models() -> None:
    items = [workload("web")]
    as_json = json.loads(output.dump(items, "json"))
    assert as_json[0]["spec"]["name"] == "web"
    assert as_json[0]["spec"]["kind"] == "PROCESS"
    assert yaml.safe_load(output.dump(items[0], "yaml"))["spec"]["replicas"] == 3


def test_json_and_yaml_show_times_and_spans_as_the_api_does() -> None:
    w = workload("web").model_copy(update={"created_at": 1795000000.5, "updated_at": 0.0})
    shown = json.loads(output.dump(w, "json"))
    assert shown["create_time"] == "2026-11-18T11:06:40.500000Z"
    assert shown["update_time"] is None
    assert "created_at" not in shown
    assert shown["spec"]["stop_grace_period"] == "10s"
    assert shown["etag"] == w.etag
    node = Node(name="n1", last_heartbeat=1795000000.0, instance_count=2)
    (row,) = yaml.safe_load(output.dump([node], "yaml"))
    assert row["last_heartbeat_time"] == "2026-11-18T11:06:40Z"
    assert row["instance_count"] == 2
    assert row["etag"] == convert.node_to_pb(node).etag  # what --etag takes


def test_describe_workload_lists_unschedulable_reasons() -> None:
    w = workload("big", 2)
    w.status.unschedulable_reasons = ["3 nodes: insufficient memory", "1 node: cordoned"]
    text = output.describe_workload(w, [Instance(name="big-1", workload="big")], NOW)
    lines = text.splitlines()
    start = lines.index("Unschedulable:")
    assert lines[start + 1 : start + 3] == [
        "  3 nodes: insufficient memory",
        "  1 node: cordoned",
    ]
    assert "big-1" in text


def test_describe_workload_shows_who_and_the_secret_keys_only() -> None:
    w = Workload(
        spec=WorkloadSpec(
            name="db", kind="PROCESS", command=["x"], secret_env={"PASSWORD": "<redacted>"}
        ),
        created_by="admin/admin",
        updated_by="admin/alice",
    )
    lines = output.describe_workload(w, [], NOW).splitlines()
    assert "Created by:     admin/admin" in lines
    assert "Updated by:     admin/alice" in lines
    assert "Secret env:     PASSWORD" in lines


def test_age() -> None:
    assert output.age(NOW - 5, NOW) == "5s"
    assert output.age(NOW - 300, NOW) == "5m"
    assert output.age(NOW - 3 * 86400, NOW) == "3d"
    assert output.age(0, NOW) == "<none>"
    assert output.age(NOW, NOW) == "0s"
    assert InstancePhase.PENDING.value == "PENDING"


def test_describe_workload_names_its_user() -> None:
    def user_line(**fields: str) -> list[str]:
        spec = WorkloadSpec(name="w", kind="PROCESS", command=["x"], **fields)
        text = output.describe_workload(Workload(spec=spec, created_at=NOW), [], NOW)
        return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("User")]

    assert user_line() == []  # the node's default user: nothing to say
    assert user_line(user="daemon") == ["daemon"]
    assert user_line(user="daemon", group="nogroup") == ["daemon:nogroup"]
    assert user_line(group="nogroup") == ["(node default):nogroup"]


@pytest.mark.parametrize(
    ("schedulable", "draining", "leaving", "shown"),
    [
        (True, False, False, "true"),
        (False, False, False, "false (cordoned)"),
        (False, True, False, "false (draining)"),
        (False, True, True, "false (draining)"),  # the operator's drain outlives the leave
        (True, False, True, "false (leaving)"),
        (False, False, True, "false (cordoned)"),  # the operator's cordon outlives the leave
    ],
)
def test_schedulable_column_names_why_not(
    schedulable: bool, draining: bool, leaving: bool, shown: str
) -> None:
    n = Node(name="n1", schedulable=schedulable, draining=draining, leaving=leaving)
    assert output.schedulable(n) == shown


def test_instances_show_their_address_and_ports() -> None:
    inst = Instance(
        name="web-1",
        workload="web",
        node="node-1",
        phase=InstancePhase.RUNNING,
        address="10.88.0.5",
        host_ip="192.0.2.7",
        ports=[
            PortBinding(name="http", port=8080, host_port=20001),
            PortBinding(name="dns", port=53, host_port=20002, protocol=PortProtocol.UDP),
            PortBinding(name="admin", port=9000, host_port=9000),
        ],
    )
    header, row = output.instances_table([inst], NOW).splitlines()
    assert header.split()[4:6] == ["ADDRESS", "PORTS"]
    assert row.split()[4:6] == ["10.88.0.5", "20001->8080,20002->53/udp,9000"]
    text = output.describe_instance(inst, NOW)
    assert "Address:" in text and "10.88.0.5" in text and "192.0.2.7" in text
    ports = text.split("Ports:", 1)[1].splitlines()
    assert [line.split() for line in ports if line.strip()] == [
        ["NAME", "PORT", "HOST", "PORT", "PROTOCOL"],
        ["http", "8080", "20001", "tcp"],
        ["dns", "53", "20002", "udp"],
        ["admin", "9000", "9000", "tcp"],
    ]
    bare = Instance(name="web-2", workload="web")
    assert output.instances_table([bare], NOW).splitlines()[1].split()[4:6] == ["<none>", "<none>"]
    assert "Ports:  <none>" in output.describe_instance(bare, NOW)


def test_endpoints_table() -> None:
    eps = [
        Endpoint(
            instance="web-1",
            node="node-1",
            address="10.88.0.5",
            host_ip="127.0.0.1",
            ports=[PortBinding(name="http", port=8080, host_port=20001)],
        ),
        Endpoint(instance="p-1", node="node-2", host_ip="127.0.0.1", ports=[]),
    ]
    header, *rows = output.endpoints_table(eps).splitlines()
    assert header.split() == ["INSTANCE", "NODE", "ADDRESS", "HOST", "IP", "PORTS"]
    assert [r.split() for r in rows] == [
        ["web-1", "node-1", "10.88.0.5", "127.0.0.1", "20001->8080"],
        ["p-1", "node-2", "<none>", "127.0.0.1", "<none>"],
    ]
