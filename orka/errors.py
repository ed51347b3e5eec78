"""One error tree for the whole code base, and its one wire form (AIP-193).

Servers turn an OrkaError into a `google.rpc.Status` once (`orka.rpc.server`), clients turn
that status back into the same class once (`from_rpc_error`, used by `orka.rpc.client.call`);
nothing else knows about gRPC codes. Every status carries an `ErrorInfo` (domain `orka.io`)
whose `reason` names the class, so a client rebuilds the exact class from the reason, never
from the message; an `Invalid` naming fields also carries a `BadRequest` with one
`FieldViolation` per field, and an error that a plain retry can fix carries a `RetryInfo`.

| class             | gRPC code           | ErrorInfo.reason   | retry (RetryInfo)          |
| ----------------- | ------------------- | ------------------ | -------------------------- |
| OrkaError         | INTERNAL            | INTERNAL           | no                         |
| Invalid           | INVALID_ARGUMENT    | INVALID_ARGUMENT   | no                         |
| NotFound          | NOT_FOUND           | NOT_FOUND          | no                         |
| AlreadyExists     | ALREADY_EXISTS      | ALREADY_EXISTS     | no                         |
| Conflict          | FAILED_PRECONDITION | CONFLICT           | no                         |
| RuntimeFailure    | FAILED_PRECONDITION | RUNTIME_FAILURE    | no                         |
| Aborted           | ABORTED             | ABORTED            | no (re-read, then retry)   |
| OutOfRange        | OUT_OF_RANGE        | REVISION_TOO_OLD   | no (list again, then watch)|
| Unauthenticated   | UNAUTHENTICATED     | UNAUTHENTICATED    | no                         |
| PermissionDenied  | PERMISSION_DENIED   | PERMISSION_DENIED  | no                         |
| ResourceExhausted | RESOURCE_EXHAUSTED  | RESOURCE_EXHAUSTED | when `retry_after` is set  |
| Unavailable       | UNAVAILABLE         | UNAVAILABLE        | yes, after 1 s             |
| NotLeader         | UNAVAILABLE         | NOT_LEADER         | yes: at once at `leader`   |

One pair shares a code because gRPC has no second fitting one, and the reason tells them apart:
Conflict and RuntimeFailure are both FAILED_PRECONDITION: the system (an object's state, a
node's runtime: a missing image or binary) is not in the state the request needs, and retrying
unchanged does not help. ABORTED is taken by concurrency (Aborted), INTERNAL and UNKNOWN would
blame the server for what the user can fix. (A runtime failure reaches users as an instance's
reason and message, not as an RPC error; the class keeps its own reason for the agent's calls.)
A workload that fits no node is no error either: its instances stay PENDING with the reasons.
NotLeader is an Unavailable (every caller that handles Unavailable handles it) whose reason and
`leader` metadata tell a client where to go instead, rather than prose to parse.

ErrorInfo metadata keys (lowerCamelCase, AIP-193): `leader` (NotLeader: the leader's HOST:PORT),
`lastRevision` (any error with a `last_revision`: a watch cut off after that revision) and
`moreViolations` (Invalid: bad fields found beyond the ones its BadRequest names).
A status without Orka's ErrorInfo (a proxy, gRPC itself) maps back by its code alone, to the
first class of the table with that code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "orka.io"
# The trailer gRPC and grpcurl read rich details from (grpcio-status uses the same key).
DETAILS_KEY = "grpc-status-details-bin"
# Bounds of what one error carries: all of it travels in a trailer, and a client refuses
# trailers past 8 KiB by default (the call would fail with no status at all).
MAX_VIOLATIONS = 5
MAX_DETAIL_CHARS = 256
MAX_MESSAGE_CHARS = 1024
# ErrorInfo metadata of an Invalid: how many bad fields there were beyond those it names.
MORE_VIOLATIONS = "moreViolations"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad field of a request: `field` is its path as the request writes it
    (`spec.replicas`, `spec.command[2]`, `spec.env['KEY']`), `description` says what is wrong."""

    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


class OrkaError(Exception):
    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = "INTERNAL"
    # Seconds after which the same request may succeed; None: retrying unchanged will not help.
    retry_after: float | None = None

    def __init__(
        self,
        message: str,
        *,
        metadata: Mapping[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})
        if retry_after is not None:
            self.retry_after = retry_after

    def error_metadata(self) -> dict[str, str]:
        """ErrorInfo.metadata: what was given, and the attributes the table above names."""
        out = dict(self.metadata)
        last = getattr(self, "last_revision", None)
        if last is not None:
            out["lastRevision"] = str(last)
        return out

    def violations(self) -> list[FieldViolation]:
        return []


class Invalid(OrkaError):
    """A request (or flag, or file) that can never succeed as written.

    `field` names the one bad field (`Invalid("spec.replicas: must be >= 0",
    field="spec.replicas")`; the "field: " prefix of the message is not repeated in its
    description), `fields` several at once."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(
        self,
        message: str,
        field: str | None = None,
        *,
        fields: Iterable[FieldViolation] = (),
        metadata: Mapping[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, metadata=metadata, retry_after=retry_after)
        found = list(fields)
        if field is not None:
            found.insert(0, FieldViolation(field, message.removeprefix(f"{field}: ")))
        self.fields: list[FieldViolation] = found

    @classmethod
    def at(cls, field: str, description: str) -> Invalid:
        """The usual form: one field and what is wrong with it, the message being both."""
        return cls(f"{field}: {description}", field=field)

    def violations(self) -> list[FieldViolation]:
        return self.fields


class NotFound(OrkaError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class AlreadyExists(OrkaError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "ALREADY_EXISTS"


class Conflict(OrkaError):
    """The object is not in a state that allows the request (a workload being deleted), or a
    write lost to another writer inside the store."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "CONFLICT"


class Aborted(OrkaError):
    """A compare-and-swap the caller asked for lost: a stale etag. Re-read, then retry."""

    code = grpc.StatusCode.ABORTED
    reason = "ABORTED"


class OutOfRange(OrkaError):
    """A watch asked to resume from a revision older than the history the server still holds:
    list again, then watch from the list's revision."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "REVISION_TOO_OLD"


class Unauthenticated(OrkaError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDenied(OrkaError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class ResourceExhausted(OrkaError):
    """A quota or a buffer is used up. A watcher cut off for falling behind has a
    `last_revision` (the last event it was sent) and may subscribe again at once."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"
    last_revision: int | None = None


class Unavailable(OrkaError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"
    retry_after = 1.0


class NotLeader(Unavailable):
    """A follower controller's answer: the request was not acted on; send it to `leader`
    (HOST:PORT), or, when no leader is known yet, anywhere again shortly."""

    reason = "NOT_LEADER"

    def __init__(
        self,
        message: str,
        *,
        leader: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        meta = dict(metadata or {})
        if leader:
            meta["leader"] = leader
        if retry_after is None and meta.get("leader"):
            retry_after = 0.0
        super().__init__(message, metadata=meta, retry_after=retry_after)

    @property
    def leader(self) -> str | None:
        return self.metadata.get("leader") or None


class RuntimeFailure(OrkaError):
    """A runtime driver could not do what was asked (bad image, missing binary, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "RUNTIME_FAILURE"


# The table above, in order: the first class of a code is the one a bare code maps back to.
CLASSES: tuple[type[OrkaError], ...] = (
    OrkaError,
    Invalid,
    NotFound,
    AlreadyExists,
    Conflict,
    RuntimeFailure,
    Aborted,
    OutOfRange,
    Unauthenticated,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    NotLeader,
)
_BY_REASON: dict[str, type[OrkaError]] = {cls.reason: cls for cls in CLASSES}
_BY_CODE: dict[grpc.StatusCode, type[OrkaError]] = {}
for _cls in CLASSES[1:]:  # a bare INTERNAL (or any unmapped code) stays an OrkaError
    _BY_CODE.setdefault(_cls.code, _cls)
assert len(_BY_REASON) == len(CLASSES), "two classes share a reason"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_rpc_status(err: OrkaError) -> status_pb2.Status:
    """The google.rpc.Status a server sends for `err`: its code and message, an ErrorInfo
    always, a BadRequest when it names fields, a RetryInfo when a retry helps."""
    status = status_pb2.Status(code=err.code.value[0], message=wire_message(err))
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN)
    for key, value in err.error_metadata().items():
        info.metadata[key] = _cut(value, MAX_DETAIL_CHARS)
    status.details.add().Pack(info)
    violations = err.violations()[:MAX_VIOLATIONS]
    if violations:
        bad = error_details_pb2.BadRequest()
        for v in violations:
            bad.field_violations.add(
                field=_cut(v.field, MAX_DETAIL_CHARS),
                description=_cut(v.description, MAX_DETAIL_CHARS),
            )
        status.details.add().Pack(bad)
    if err.retry_after is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(int(max(err.retry_after, 0.0) * 1e9))
        status.details.add().Pack(retry)
    return status


def wire_message(err: OrkaError) -> str:
    """The status message: the error's own, bounded (it also travels as a header)."""
    return _cut(err.message, MAX_MESSAGE_CHARS)


def trailing_metadata(err: OrkaError) -> tuple[tuple[str, bytes], ...]:
    """The trailer that carries `err`'s rich status (what `grpc_status.rpc_status.to_status`
    builds), for `context.abort(code, message, trailing_metadata=...)`."""
    return ((DETAILS_KEY, to_rpc_status(err).SerializeToString()),)


def from_status(
    code: grpc.StatusCode, details: str, status: status_pb2.Status | None = None
) -> OrkaError:
    """The OrkaError a client raises for a failed call: the class its ErrorInfo reason names
    (with that class's code), else the class of its code, with field violations, metadata and
    retry delay restored."""
    message = details or code.name
    info: error_details_pb2.ErrorInfo | None = None
    bad: list[FieldViolation] = []
    retry_after: float | None = None
    if status is not None and status.code == code.value[0]:
        for any_ in status.details:
            if any_.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                any_.Unpack(info)
            elif any_.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                req = error_details_pb2.BadRequest()
                any_.Unpack(req)
                bad.extend(FieldViolation(v.field, v.description) for v in req.field_violations)
            elif any_.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                any_.Unpack(retry)
                retry_after = retry.retry_delay.ToNanoseconds() / 1e9
    cls = _BY_CODE.get(code, OrkaError)
    metadata: dict[str, str] = {}
    if info is not None and info.domain == DOMAIN:
        by_reason = _BY_REASON.get(info.reason)
        # A reason that disagrees with the code is not trusted over the code.
        if by_reason is not None and (by_reason.code == code or by_reason is OrkaError):
            cls = by_reason
        metadata = dict(info.metadata)
    kwargs: dict[str, Any] = {"metadata": metadata, "retry_after": retry_after}
    if cls is Invalid:
        kwargs["fields"] = bad
    err = cls(message, **kwargs)
    if "lastRevision" in metadata:
        try:
            err.last_revision = int(metadata["lastRevision"])  # type: ignore[attr-defined]
        except ValueError:
            pass
    return err


def rich_status(err: grpc.RpcError) -> status_pb2.Status | None:
    """The google.rpc.Status in a failed call's trailer, if it carries a readable one. Works on
    a sync call and on grpc.aio's AioRpcError alike (grpcio-status' `from_call` needs a call
    object for aio, which an AioRpcError is not)."""
    trailer = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailer or ():
        if key == DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:
                return None
    return None


def from_rpc_error(err: grpc.RpcError) -> OrkaError:
    """The one client boundary: a failed call as the OrkaError the server raised."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else ""
    return from_status(code, details or "", rich_status(err))
