"""One error tree for the whole code base.

Servers map it to gRPC status codes once (`orka.rpc.server`), clients map codes back once
(`orka.rpc.client`); nothing else knows about gRPC codes.
"""

from __future__ import annotations

import grpc


class OrkaError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Invalid(OrkaError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(OrkaError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(OrkaError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Conflict(OrkaError):
    """A compare-and-swap lost, or the object is not in a state that allows the request."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(OrkaError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(OrkaError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unschedulable(OrkaError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ResourceExhausted(OrkaError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfRange(OrkaError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unavailable(OrkaError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(OrkaError):
    code = grpc.StatusCode.ABORTED


class RuntimeFailure(OrkaError):
    """A runtime driver could not do what was asked (bad image, missing binary, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE: dict[grpc.StatusCode, type[OrkaError]] = {
    cls.code: cls
    for cls in (
        Invalid,
        NotFound,
        AlreadyExists,
        Conflict,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        OutOfRange,
        Unavailable,
        Aborted,
    )
}


def from_status(code: grpc.StatusCode, details: str) -> OrkaError:
    cls = _BY_CODE.get(code, OrkaError)
    err = cls(details or code.name)
    return err
