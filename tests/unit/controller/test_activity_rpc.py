"""ListActivities: the object's entries newest first, paged; bad input named, unknown NOT_FOUND."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orka.api import controller_pb2 as pb
from orka.controller.activity import NORMAL, WARNING, ActivityLog
from orka.controller.activity_rpc import list_activities
from orka.errors import Invalid, NotFound


def repo() -> SimpleNamespace:
    return SimpleNamespace(workloads={}, instances={"web-1": object()}, nodes={"n1": object()})


def test_pages_newest_first_and_the_token_resumes() -> None:
    log = ActivityLog()
    for n in range(5):
        log.record("instance", "web-1", NORMAL if n % 2 else WARNING, f"R{n}", f"m{n}")
    first = list_activities(
        log, repo(), pb.ListActivitiesRequest(object="instance/web-1", page_size=3)
    )  # type: ignore[arg-type]
    assert [a.reason for a in first.activities] == ["R4", "R3", "R2"]
    assert first.activities[0].type == pb.Activity.WARNING
    assert first.activities[1].type == pb.Activity.NORMAL
    assert first.activities[0].count == 1 and first.activities[0].last_time.seconds > 0
    req = pb.ListActivitiesRequest(
        object="instance/web-1", page_size=3, page_token=first.next_page_token
    )
    rest = list_activities(log, repo(), req)  # type: ignore[arg-type]
    assert [a.reason for a in rest.activities] == ["R1", "R0"]
    assert rest.next_page_token == ""


def test_an_existing_object_without_entries_is_an_empty_list() -> None:
    got = list_activities(ActivityLog(), repo(), pb.ListActivitiesRequest(object="node/n1"))  # type: ignore[arg-type]
    assert list(got.activities) == [] and got.next_page_token == ""


@pytest.mark.parametrize("value", ["", "web-1", "pod/web-1", "instance/", "x" * 600])
def test_a_bad_object_is_invalid_naming_the_field(value: str) -> None:
    with pytest.raises(Invalid) as err:
        list_activities(ActivityLog(), repo(), pb.ListActivitiesRequest(object=value))  # type: ignore[arg-type]
    assert [v.field for v in err.value.violations()] == ["object"]


def test_an_unknown_object_is_not_found_and_a_foreign_token_invalid() -> None:
    with pytest.raises(NotFound):
        list_activities(ActivityLog(), repo(), pb.ListActivitiesRequest(object="workload/nope"))  # type: ignore[arg-type]
    with pytest.raises(Invalid):
        req = pb.ListActivitiesRequest(object="node/n1", page_token="bm90IG91cnM")
        list_activities(ActivityLog(), repo(), req)  # type: ignore[arg-type]
