"""The error tree maps to gRPC codes and back."""

from __future__ import annotations

import grpc
import pytest

from orka import errors


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.Invalid),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.Conflict),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.INTERNAL, errors.OrkaError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.OrkaError),
        (grpc.StatusCode.UNKNOWN, errors.OrkaError),
    ],
)
def test_from_status_maps_code_to_class(code: grpc.StatusCode, cls: type) -> None:
    err = errors.from_status(code, "details here")
    assert type(err) is cls
    assert err.message == "details here"
    assert str(err) == "details here"


@pytest.mark.parametrize(
    "cls",
    [
        errors.Invalid,
        errors.NotFound,
        errors.AlreadyExists,
        errors.Conflict,
        errors.Unauthenticated,
        errors.PermissionDenied,
        errors.ResourceExhausted,
        errors.Unavailable,
        errors.Unschedulable,
        errors.RuntimeFailure,
    ],
)
def test_round_trip_keeps_code(cls: type[errors.OrkaError]) -> None:
    back = errors.from_status(cls.code, "m")
    assert back.code == cls.code
    assert isinstance(back, errors.OrkaError)


def test_empty_details_fall_back_to_code_name() -> None:
    assert errors.from_status(grpc.StatusCode.NOT_FOUND, "").message == "NOT_FOUND"


def test_every_error_is_an_orka_error() -> None:
    for cls in (errors.Invalid, errors.Unschedulable, errors.RuntimeFailure):
        assert issubclass(cls, errors.OrkaError)
    assert errors.OrkaError("x").code is grpc.StatusCode.INTERNAL
