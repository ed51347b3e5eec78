"""The error tree maps to google.rpc.Status and back: every class, through a real grpc.aio
server (the `unary` and `stream` boundaries) and `orka.rpc.client.call`, comes back as the
exact class with its reason, metadata, field violations and retry delay."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from orka import errors
from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.errors import FieldViolation
from orka.rpc.client import call, secure_channel
from orka.rpc.server import boundaries, start_server, stream, unary
from orka.security.identity import Identity
from orka.security.tls import TlsFiles

C = grpc.StatusCode

# The module docstring's table: class, code, reason, default retry delay.
TABLE: list[tuple[type[errors.OrkaError], grpc.StatusCode, str, float | None]] = [
    (errors.OrkaError, C.INTERNAL, "INTERNAL", None),
    (errors.Invalid, C.INVALID_ARGUMENT, "INVALID_ARGUMENT", None),
    (errors.NotFound, C.NOT_FOUND, "NOT_FOUND", None),
    (errors.AlreadyExists, C.ALREADY_EXISTS, "ALREADY_EXISTS", None),
    (errors.Conflict, C.FAILED_PRECONDITION, "CONFLICT", None),
    (errors.RuntimeFailure, C.FAILED_PRECONDITION, "RUNTIME_FAILURE", None),
    (errors.Aborted, C.ABORTED, "ABORTED", None),
    (errors.OutOfRange, C.OUT_OF_RANGE, "REVISION_TOO_OLD", None),
    (errors.Unauthenticated, C.UNAUTHENTICATED, "UNAUTHENTICATED", None),
    (errors.PermissionDenied, C.PERMISSION_DENIED, "PERMISSION_DENIED", None),
    (errors.ResourceExhausted, C.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED", None),
    (errors.Unavailable, C.UNAVAILABLE, "UNAVAILABLE", 1.0),
    (errors.NotLeader, C.UNAVAILABLE, "NOT_LEADER", 1.0),
]


def test_the_table_is_the_modules() -> None:
    assert [row[0] for row in TABLE] == list(errors.CLASSES)
    for cls, code, reason, retry in TABLE:
        assert (cls.code, cls.reason, cls("m").retry_after) == (code, reason, retry), cls


def test_no_two_classes_share_a_reason_and_only_the_named_pairs_share_a_code() -> None:
    assert len({cls.reason for cls in errors.CLASSES}) == len(errors.CLASSES)
    by_code: dict[grpc.StatusCode, list[str]] = {}
    for cls in errors.CLASSES:
        by_code.setdefault(cls.code, []).append(cls.__name__)
    shared = sorted(names for names in by_code.values() if len(names) > 1)
    assert shared == [
        ["Conflict", "RuntimeFailure"],
        ["Unavailable", "NotLeader"],
    ]


def cut_off(revision: int) -> errors.ResourceExhausted:
    err = errors.ResourceExhausted("fell behind; list again", retry_after=0.5)
    err.last_revision = revision  # as the watch sets it
    return err


# Each class plain, and the forms that carry details.
CASES: list[errors.OrkaError] = [
    *(cls("plain " + cls.__name__) for cls in errors.CLASSES if cls is not errors.NotLeader),
    errors.Invalid("spec.replicas: must be >= 0", field="spec.replicas"),
    errors.Invalid(
        "spec.command[2]: contains a NUL byte; spec.env['K']: too long",
        fields=[
            FieldViolation("spec.command[2]", "contains a NUL byte"),
            FieldViolation("spec.env['K']", "too long"),
        ],
    ),
    errors.NotLeader("not the leader; the leader is at 10.0.0.7:7443", leader="10.0.0.7:7443"),
    errors.NotLeader("not the leader; no leader is elected yet, retry shortly"),
    cut_off(41),
    errors.RuntimeFailure("process: command 'nope' not found"),
    errors.Aborted("workload 'web' changed since it was read (etag); read it again"),
    errors.OutOfRange("revision 3 is older than the history kept (from 90); list again"),
    errors.Conflict("workload 'web' is being deleted", metadata={"workload": "web"}),
]


def describe(err: errors.OrkaError) -> tuple[Any, ...]:
    return (
        type(err),
        err.code,
        err.message,
        err.violations(),
        err.error_metadata(),
        err.retry_after,
        getattr(err, "last_revision", None),
    )


@boundaries(GetNode=unary(roles={"admin"}), WatchEvents=stream(roles={"admin"}))
class Failing(pb_grpc.ControllerServicer):
    """Raises whatever the test sets, from a unary handler or after a stream's first item."""

    error: Exception = errors.OrkaError("unset")

    async def GetNode(self, request: pb.GetNodeRequest, who: Identity) -> pb.Node:
        raise self.error

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, who: Identity
    ) -> AsyncIterator[pb.Event]:
        yield pb.Event()
        raise self.error


@pytest.fixture
async def served(certs_dir: Path) -> AsyncIterator[tuple[Failing, pb_grpc.ControllerStub]]:
    servicer = Failing()
    server, port, _ = await start_server(
        "127.0.0.1:0",
        TlsFiles.for_service(certs_dir, "controller", "controller"),
        [lambda s: pb_grpc.add_ControllerServicer_to_server(servicer, s)],
        ["orka.v1.Controller"],
    )
    channel = secure_channel(
        f"127.0.0.1:{port}", TlsFiles.for_service(certs_dir, "admin", "admin"), "controller"
    )
    try:
        yield servicer, pb_grpc.ControllerStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def test_every_class_round_trips_through_a_real_server_exactly(
    served: tuple[Failing, pb_grpc.ControllerStub],
) -> None:
    servicer, stub = served
    for sent in CASES:
        servicer.error = sent
        with pytest.raises(errors.OrkaError) as got:
            await call(stub.GetNode, pb.GetNodeRequest(name="x"))
        assert describe(got.value) == describe(sent), sent
        # The stream boundary sends the same status after what it already yielded.
        watch = stub.WatchEvents(pb.WatchEventsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in watch:
                pass
        assert describe(errors.from_rpc_error(raw.value)) == describe(sent), sent


async def test_the_wire_status_holds_error_info_bad_request_and_retry_info(
    served: tuple[Failing, pb_grpc.ControllerStub],
) -> None:
    """What grpcurl and other clients read: the google.rpc detail messages themselves."""
    servicer, stub = served
    servicer.error = errors.Invalid(
        "spec.replicas: must be >= 0; spec.name: is required",
        fields=[FieldViolation("spec.replicas", "must be >= 0"), FieldViolation("spec.name", "")],
    )
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.GetNode(pb.GetNodeRequest(name="x"))
    status = errors.rich_status(raw.value)
    assert status is not None
    assert (status.code, status.message) == (C.INVALID_ARGUMENT.value[0], raw.value.details())
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    assert [d.type_url.rsplit(".", 1)[-1] for d in status.details] == ["ErrorInfo", "BadRequest"]
    status.details[0].Unpack(info)
    status.details[1].Unpack(bad)
    assert (info.reason, info.domain, dict(info.metadata)) == ("INVALID_ARGUMENT", "orka.io", {})
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("spec.replicas", "must be >= 0"),
        ("spec.name", ""),
    ]

    servicer.error = errors.NotLeader("not the leader; the leader is at h:1", leader="h:1")
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.GetNode(pb.GetNodeRequest(name="x"))
    status = errors.rich_status(raw.value)
    assert status is not None and raw.value.code() is C.UNAVAILABLE
    retry = error_details_pb2.RetryInfo()
    status.details[0].Unpack(info)
    status.details[1].Unpack(retry)
    assert (info.reason, dict(info.metadata)) == ("NOT_LEADER", {"leader": "h:1"})
    assert retry.retry_delay.ToNanoseconds() == 0


async def test_anything_else_is_internal_with_no_detail_of_it(
    served: tuple[Failing, pb_grpc.ControllerStub],
) -> None:
    servicer, stub = served
    servicer.error = KeyError("secret-key-name")
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.GetNode(pb.GetNodeRequest(name="x"))
    assert (raw.value.code(), raw.value.details()) == (C.INTERNAL, "internal error: KeyError")
    assert errors.rich_status(raw.value) is None
    assert type(errors.from_rpc_error(raw.value)) is errors.OrkaError


async def test_the_details_stay_within_a_trailer_a_client_accepts(
    served: tuple[Failing, pb_grpc.ControllerStub],
) -> None:
    servicer, stub = served
    many = [FieldViolation(f"spec.env['K{i}']" + "x" * 900, "y" * 900) for i in range(50)]
    servicer.error = errors.Invalid("z" * 10_000, fields=many, metadata={"k": "v" * 5000})
    with pytest.raises(errors.Invalid) as got:
        await call(stub.GetNode, pb.GetNodeRequest(name="x"))
    back = got.value
    assert len(back.fields) == errors.MAX_VIOLATIONS
    limit = errors.MAX_DETAIL_CHARS
    assert all(len(v.field) <= limit and len(v.description) <= limit for v in back.fields)
    assert back.fields[0].field.startswith("spec.env['K0']xxx")
    assert len(back.message) == errors.MAX_MESSAGE_CHARS and back.message.endswith("...")
    assert len(back.metadata["k"]) == errors.MAX_DETAIL_CHARS
    # Base64 on the wire, beside the message in its own header: within the 8 KiB a client takes.
    [(_, trailer)] = errors.trailing_metadata(servicer.error)  # type: ignore[arg-type]
    assert len(base64.b64encode(trailer)) + len(back.message) < 8 * 1024


# ---- from_status alone: statuses without Orka's details ----


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (C.INVALID_ARGUMENT, errors.Invalid),
        (C.NOT_FOUND, errors.NotFound),
        (C.ALREADY_EXISTS, errors.AlreadyExists),
        (C.FAILED_PRECONDITION, errors.Conflict),
        (C.ABORTED, errors.Aborted),
        (C.OUT_OF_RANGE, errors.OutOfRange),
        (C.UNAUTHENTICATED, errors.Unauthenticated),
        (C.PERMISSION_DENIED, errors.PermissionDenied),
        (C.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (C.UNAVAILABLE, errors.Unavailable),
        (C.INTERNAL, errors.OrkaError),
        (C.DEADLINE_EXCEEDED, errors.OrkaError),
        (C.UNKNOWN, errors.OrkaError),
    ],
)
def test_a_bare_code_maps_to_the_first_class_of_that_code(code: grpc.StatusCode, cls: type) -> None:
    err = errors.from_status(code, "details here")
    assert type(err) is cls
    assert (err.message, str(err)) == ("details here", "details here")


def test_empty_details_fall_back_to_code_name() -> None:
    assert errors.from_status(C.NOT_FOUND, "").message == "NOT_FOUND"


def status_with(code: grpc.StatusCode, reason: str, domain: str = errors.DOMAIN) -> Any:
    status = status_pb2.Status(code=code.value[0], message="m")
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain))
    return status


def test_a_reason_is_trusted_only_with_its_own_code_and_domain() -> None:
    rebuilt = errors.from_status(
        C.FAILED_PRECONDITION, "m", status_with(C.FAILED_PRECONDITION, "RUNTIME_FAILURE")
    )
    assert type(rebuilt) is errors.RuntimeFailure
    # A reason of another code, an unknown reason, another domain, or a status whose code
    # differs from the call's: the code decides.
    for code, status in [
        (C.FAILED_PRECONDITION, status_with(C.FAILED_PRECONDITION, "NOT_LEADER")),
        (C.FAILED_PRECONDITION, status_with(C.FAILED_PRECONDITION, "NO_SUCH_REASON")),
        (C.FAILED_PRECONDITION, status_with(C.FAILED_PRECONDITION, "RUNTIME_FAILURE", "x.io")),
        (C.FAILED_PRECONDITION, status_with(C.UNAVAILABLE, "RUNTIME_FAILURE")),
    ]:
        assert type(errors.from_status(code, "m", status)) is errors.Conflict


def test_invalid_field_forms() -> None:
    one = errors.Invalid("spec.replicas: must be >= 0", field="spec.replicas")
    assert one.fields == [FieldViolation("spec.replicas", "must be >= 0")]
    assert str(one.fields[0]) == "spec.replicas: must be >= 0"
    at = errors.Invalid.at("spec.image", "is required")
    assert (at.message, at.fields) == (
        "spec.image: is required",
        [FieldViolation("spec.image", "is required")],
    )
    assert errors.Invalid("no field").violations() == []


def test_not_leader_is_an_unavailable_that_retries_at_once_only_where_it_points() -> None:
    at = errors.NotLeader("m", leader="h:1")
    assert isinstance(at, errors.Unavailable)
    assert (at.leader, at.retry_after, at.error_metadata()) == ("h:1", 0.0, {"leader": "h:1"})
    nowhere = errors.NotLeader("m")
    assert (nowhere.leader, nowhere.retry_after, nowhere.error_metadata()) == (None, 1.0, {})
