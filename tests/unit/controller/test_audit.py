"""The audit log on its own: what a record holds, which calls are recorded, the file."""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from structlog.testing import capture_logs

from orka.api import controller_pb2 as pb
from orka.controller.audit import (
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    AuditLog,
    object_of,
    rfc3339,
    to_record,
)
from orka.rpc.server import Call, Caller
from orka.security.identity import Identity

ADMIN = Caller(identity=Identity("admin", "admin"), serial="1F2E", peer="ipv4:127.0.0.1:5000")


def call(
    method: str = "CreateWorkload",
    request: object = None,
    code: grpc.StatusCode = grpc.StatusCode.OK,
    message: str = "",
    caller: Caller = ADMIN,
) -> Call:
    if request is None:
        request = pb.CreateWorkloadRequest(spec=pb.WorkloadSpec(name="web"))
    return Call(method, request, caller, code, message)


@pytest.mark.parametrize(
    ("method", "request_", "kind", "name"),
    [
        (
            "CreateWorkload",
            pb.CreateWorkloadRequest(spec=pb.WorkloadSpec(name="web")),
            "workload",
            "web",
        ),
        (
            "UpdateWorkload",
            pb.UpdateWorkloadRequest(spec=pb.WorkloadSpec(name="db")),
            "workload",
            "db",
        ),
        ("DeleteWorkload", pb.DeleteWorkloadRequest(name="web"), "workload", "web"),
        ("CordonNode", pb.CordonNodeRequest(name="node-1"), "node", "node-1"),
        ("UncordonNode", pb.UncordonNodeRequest(name="node-2"), "node", "node-2"),
        ("DrainNode", pb.DrainNodeRequest(name="n"), "node", "n"),
        ("ListInstances", pb.ListInstancesRequest(workload="web"), "instances", ""),
        ("LabelNodePool", pb.GetNodeRequest(name="x"), "node_pool", "x"),
    ],
)
def test_the_object_comes_from_the_method_name_and_the_request(
    method: str, request_: object, kind: str, name: str
) -> None:
    assert object_of(method, request_) == {"kind": kind, "name": name}


def test_a_huge_name_is_cut_short() -> None:
    got = object_of("DeleteWorkload", pb.DeleteWorkloadRequest(name="x" * 1_000_000))
    assert len(got["name"]) == 253 and got["name"].endswith("…")


def test_a_record_holds_caller_object_outcome_and_time() -> None:
    when = dt.datetime(2026, 11, 26, 12, 0, 1, 234000, tzinfo=dt.UTC)
    record = to_record(call(code=grpc.StatusCode.ALREADY_EXISTS, message="exists"), when)
    assert record == {
        "time": "2026-11-26T12:00:01.234Z",
        "method": "CreateWorkload",
        "caller": {
            "identity": "admin/admin",
            "role": "admin",
            "name": "admin",
            "serial": "1F2E",
            "peer": "ipv4:127.0.0.1:5000",
        },
        "object": {"kind": "workload", "name": "web"},
        "outcome": {"code": "ALREADY_EXISTS", "message": "exists"},
    }


def test_a_caller_without_a_usable_certificate_is_recorded_empty() -> None:
    nobody = Caller(identity=None, serial="", peer="ipv4:127.0.0.1:1")
    record = to_record(call(caller=nobody, code=grpc.StatusCode.UNAUTHENTICATED))
    assert record["caller"] == {
        "identity": "",
        "role": "",
        "name": "",
        "serial": "",
        "peer": "ipv4:127.0.0.1:1",
    }


def test_a_long_message_is_bounded() -> None:
    record = to_record(call(code=grpc.StatusCode.INVALID_ARGUMENT, message="m" * 100_000))
    assert len(record["outcome"]["message"]) == MAX_MESSAGE_CHARS


def test_writes_are_audited_and_reads_only_when_asked() -> None:
    default, everything = AuditLog(), AuditLog(reads=True)
    for method in ("CreateWorkload", "UpdateWorkload", "DeleteWorkload", "CordonNode", "Exec"):
        assert default.wants(method) and everything.wants(method)
    for method in ("GetWorkload", "ListWorkloads", "ListNodes", "WatchEvents"):
        assert not default.wants(method)
        assert everything.wants(method)


def test_the_file_gets_one_json_line_per_call_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "audit" / "audit.log"
    audit = AuditLog(path)
    audit.record(call())
    audit.record(call("DeleteWorkload", pb.DeleteWorkloadRequest(name="web\u2028x")))
    audit.close()
    audit.close()  # idempotent
    # One line each, for any reader: splitlines() also splits at U+2028.
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["method"] == "CreateWorkload" and first["object"]["name"] == "web"
    assert second["object"] == {"kind": "workload", "name": "web\u2028x"}
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_an_existing_file_is_appended_to_and_tightened(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    path.write_text('{"old": true}\n')
    path.chmod(0o644)
    audit = AuditLog(path)
    audit.record(call())
    audit.close()
    lines = path.read_text().splitlines()
    assert lines[0] == '{"old": true}' and json.loads(lines[1])["method"] == "CreateWorkload"
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_records_go_through_structlog_as_orka_audit() -> None:
    audit = AuditLog()
    with capture_logs() as logs:
        audit.record(call())
        audit.record(call(code=grpc.StatusCode.PERMISSION_DENIED, message="role agent may not"))
    assert [(e["event"], e["logger"], e["log_level"]) for e in logs] == [
        ("audit", "orka.audit", "info"),
        ("audit", "orka.audit", "warning"),
    ]
    assert logs[1]["caller"]["identity"] == "admin/admin"
    assert logs[1]["outcome"] == {"code": "PERMISSION_DENIED", "message": "role agent may not"}


def test_a_request_with_secrets_is_never_recorded(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = AuditLog(path)
    spec = pb.WorkloadSpec(name="web", secret_env={"TOKEN": "s3cr3t-value"})
    with capture_logs() as logs:
        audit.record(call(request=pb.CreateWorkloadRequest(spec=spec)))
    audit.close()
    assert "s3cr3t-value" not in path.read_text()
    assert "s3cr3t-value" not in repr(logs)


class _FullDisk:
    def __init__(self) -> None:
        self.calls = 0

    def writelines(self, lines: object) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_write_failure_is_logged_once_and_calls_go_on(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.log")
    assert audit._writer is not None
    disk = _FullDisk()
    audit._writer._file = disk  # type: ignore[assignment]
    with capture_logs() as logs:
        for i in range(1, 4):
            audit.record(call())  # never raises into the RPC
            deadline = time.monotonic() + 5
            while disk.calls < i and time.monotonic() < deadline:  # one write per record
                time.sleep(0.001)
        audit.close()
    assert disk.calls == 3
    errors = [e for e in logs if e["event"] == "cannot write the audit log"]
    assert len(errors) == 1 and errors[0]["error"] == "[Errno 28] No space left on device"


def test_the_object_of_a_call_on_an_instance_and_names_that_are_not_text() -> None:
    logs = pb.ReadLogsRequest(instance="web-1")
    assert object_of("ReadLogs", logs) == {"kind": "logs", "name": "web-1"}
    # A field of that name that holds no text is passed over for the next one.
    odd = SimpleNamespace(spec=None, name=["a"], instance="web-2")
    assert object_of("ExecInstance", odd) == {"kind": "instance", "name": "web-2"}
    longest = "n" * MAX_NAME_CHARS
    assert object_of("DeleteWorkload", pb.DeleteWorkloadRequest(name=longest))["name"] == longest


@pytest.mark.usefixtures("off_utc")
def test_times_are_utc_whatever_the_hosts_time_zone() -> None:
    plus_two = dt.timezone(dt.timedelta(hours=2))
    assert rfc3339(dt.datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=plus_two)) == (
        "2026-01-01T10:00:00.123Z"
    )


def test_an_ok_call_goes_through_structlog_whole() -> None:
    audit = AuditLog()
    with capture_logs() as logs:
        audit.record(call())
    expected = to_record(call())
    entry = logs[0]
    assert {k: entry[k] for k in ("method", "caller", "object", "outcome")} == {
        k: expected[k] for k in ("method", "caller", "object", "outcome")
    }


def test_a_record_is_one_compact_line_in_a_folder_made_for_it(tmp_path: Path) -> None:
    path = tmp_path / "var" / "log" / "orka" / "audit.log"
    audit = AuditLog(path)
    audit.record(call())
    audit.close()
    (line,) = path.read_text().splitlines()
    assert line == json.dumps(json.loads(line), separators=(",", ":"))


def test_the_writer_is_a_named_daemon_thread(tmp_path: Path) -> None:
    """Named for thread dumps; a daemon, so a process that ends without closing the log is
    not held up by it."""
    audit = AuditLog(tmp_path / "audit.log")
    try:
        writers = [t for t in threading.enumerate() if t.name == "orka-audit"]
        assert writers and all(t.daemon for t in writers)
    finally:
        audit.close()


class _FlakyDisk(_FullDisk):
    """Full until `full` is cleared; counts the writes it took and refused."""

    def __init__(self) -> None:
        super().__init__()
        self.full = True

    def writelines(self, lines: object) -> None:
        self.calls += 1
        if self.full:
            raise OSError(28, "No space left on device")


def test_each_outage_is_logged_once_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = AuditLog(path)
    assert audit._writer is not None
    disk = _FlakyDisk()
    audit._writer._file = disk  # type: ignore[assignment]

    def write(n: int) -> None:
        audit.record(call())
        deadline = time.monotonic() + 5
        while disk.calls < n and time.monotonic() < deadline:
            time.sleep(0.001)

    with capture_logs() as logs:
        write(1)
        write(2)
        disk.full = False
        write(3)  # the disk is back: the next outage is news again
        disk.full = True
        write(4)
        audit.close()
    errors = [e for e in logs if e["event"] == "cannot write the audit log"]
    assert [(e["path"], e["error"]) for e in errors] == [
        (str(path), "[Errno 28] No space left on device")
    ] * 2
