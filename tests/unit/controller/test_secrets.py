"""The rule for secret values sent back redacted (orka/controller/secrets.py)."""

from __future__ import annotations

import pytest

from orka.controller.secrets import keep_redacted
from orka.errors import Invalid
from orka.models import REDACTED, WorkloadKind, WorkloadSpec


def spec(**secrets: str) -> WorkloadSpec:
    return WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["x"], secret_env=secrets)


STORED = spec(TOKEN="t0ken", DB="pw")


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        (spec(TOKEN=REDACTED, DB=REDACTED), {"TOKEN": "t0ken", "DB": "pw"}),  # read, sent back
        (spec(TOKEN="new", DB=REDACTED), {"TOKEN": "new", "DB": "pw"}),  # one changed
        (spec(TOKEN=REDACTED), {"TOKEN": "t0ken"}),  # a key left out is removed
        (spec(), {}),
        (spec(TOKEN="", DB="x"), {"TOKEN": "", "DB": "x"}),  # an empty value is a value
    ],
)
def test_redacted_values_keep_the_stored_ones(sent: WorkloadSpec, kept: dict[str, str]) -> None:
    assert keep_redacted(STORED, sent).secret_env == kept


def test_the_merged_spec_equals_the_stored_one_when_nothing_changed() -> None:
    # UpdateWorkload compares them: a read-modify-write of nothing must not roll instances.
    assert keep_redacted(STORED, spec(TOKEN=REDACTED, DB=REDACTED)) == STORED


@pytest.mark.parametrize("old", [None, STORED])
def test_redacted_without_a_stored_secret_is_refused(old: WorkloadSpec | None) -> None:
    with pytest.raises(Invalid) as info:
        keep_redacted(old, spec(NEW=REDACTED))
    assert info.value.message == (
        "spec.secret_env: 'NEW' is '<redacted>', which keeps a stored secret, but none is stored"
        " under that key; send the value itself"
    )
    assert [v.field for v in info.value.violations()] == ["spec.secret_env"]
