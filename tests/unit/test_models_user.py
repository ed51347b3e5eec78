"""`WorkloadSpec.user` / `group`: what the API accepts, and the error when it does not."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orka.models import WorkloadSpec
from orka.rpc import convert


def spec(**fields: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"name": "w", "kind": "PROCESS", "command": ["x"], **fields})


@pytest.mark.parametrize(
    "value", ["nobody", "www-data", "_svc", "a", "user.name", "machine$", "x" * 32, "0", "65534"]
)
def test_accepted(value: str) -> None:
    s = spec(user=value, group=value)
    assert (s.user, s.group) == (value, value)
    # Through protobuf and back, as the controller and agents see it.
    assert convert.spec_from_pb(convert.spec_to_pb(s)) == s


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("no\0body", "must be a user or group name"),
        ("no\nbody", "must be a user or group name"),
        ("x" * 33, "must be a user or group name"),
        ("-rf", "must be a user or group name"),
        ("a b", "must be a user or group name"),
        ("../etc", "must be a user or group name"),
        ("a:b", "must be a user or group name"),
        ("4294967295", "out of range"),
        ("9" * 10, "out of range"),
    ],
)
@pytest.mark.parametrize("field", ["user", "group"])
def test_refused_naming_the_field(field: str, value: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        spec(**{field: value})
    [error] = info.value.errors()
    assert error["loc"] == (field,)
    assert fragment in error["msg"]


def test_error_never_echoes_unbounded_input() -> None:
    with pytest.raises(ValidationError) as info:
        spec(user="x" * 1_000_000 + "\0")
    [error] = info.value.errors()
    assert len(error["msg"]) < 200


@pytest.mark.parametrize("kind", ["CONTAINER", "VM"])
def test_only_for_process_workloads(kind: str) -> None:
    with pytest.raises(ValidationError, match="user and group apply to PROCESS workloads only"):
        WorkloadSpec.model_validate({"name": "w", "kind": kind, "image": "/img", "user": "nobody"})
