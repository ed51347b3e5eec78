"""`orka rollout status|history` output in table, json and yaml; the manifest's `update:`."""

from __future__ import annotations

import json

import pytest
import yaml

from orka.cli import rollout as cli
from orka.cli.main import build_parser
from orka.cli.manifest import parse_manifests
from orka.errors import Invalid
from orka.models import (
    Revision,
    Rollout,
    RolloutState,
    Workload,
    WorkloadKind,
    WorkloadSpec,
    WorkloadStatus,
)

NOW = 1_000_000.0


def spec(command: str, replicas: int = 6) -> WorkloadSpec:
    return WorkloadSpec(
        name="web", kind=WorkloadKind.PROCESS, command=["sleep", command], replicas=replicas
    )


def rolling() -> Workload:
    return Workload(
        spec=spec("301"),
        generation=2,
        status=WorkloadStatus(desired=6, updated=3, ready=2),
        rollout=Rollout(
            state=RolloutState.PROGRESSING,
            revision=2,
            stable=1,
            deadline=NOW + 60,
            message="",
        ),
    )


REVISIONS = [
    Revision(revision=1, spec=spec("300"), created_at=NOW - 600, created_by="admin/admin"),
    Revision(
        revision=2,
        spec=spec("301"),
        created_at=NOW - 30,
        created_by="controller",
        cause="automatic rollback to revision 1: instance web-a failed",
    ),
]


def test_status_table_is_one_line_with_the_counts_and_the_message() -> None:
    w = rolling()
    assert cli.render_status(w, "table") == (
        "workload/web revision 2: PROGRESSING, 3 of 6 updated, 2 ready"
    )
    failed = w.model_copy(
        update={
            "rollout": w.rollout.model_copy(
                update={"state": RolloutState.FAILED, "message": "no progress for 600s"}
            )
        }
    )
    assert cli.render_status(failed, "table") == (
        "workload/web revision 2: FAILED, 3 of 6 updated, 2 ready (no progress for 600s)"
    )


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_status_json_and_yaml_hold_the_same_fields(fmt: str) -> None:
    text = cli.render_status(rolling(), fmt)
    data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert data == {
        "workload": "web",
        "revision": 2,
        "state": "PROGRESSING",
        "desired": 6,
        "updated": 3,
        "ready": 2,
        "stable_revision": 1,
        "message": "",
        "deadline_time": "1970-01-12T13:47:40Z",
    }


def test_history_table_marks_the_current_revision() -> None:
    assert cli.render_history(REVISIONS, 2, "table", now=NOW).splitlines() == [
        "REVISION   AGE   BY            CAUSE",
        "1          10m   admin/admin   <none>",
        "2 *        30s   controller    automatic rollback to revision 1: instance web-a failed",
    ]


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_history_json_and_yaml_list_each_revision(fmt: str) -> None:
    text = cli.render_history(REVISIONS, 2, fmt)
    data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert data == [
        {
            "revision": 1,
            "current": False,
            "create_time": "1970-01-12T13:36:40Z",
            "created_by": "admin/admin",
            "cause": "",
            "command": ["sleep", "300"],
            "image": "",
        },
        {
            "revision": 2,
            "current": True,
            "create_time": "1970-01-12T13:46:10Z",
            "created_by": "controller",
            "cause": "automatic rollback to revision 1: instance web-a failed",
            "command": ["sleep", "301"],
            "image": "",
        },
    ]


def test_the_verbs_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["rollout", "undo", "web", "--to-revision", "3"])
    assert (args.rollout_command, args.workload, args.to_revision) == ("undo", "web", 3)
    args = parser.parse_args(["rollout", "status", "web", "--timeout", "5", "-o", "json"])
    assert (args.timeout, args.output, args.watch) == (5.0, "json", True)
    for verb in ("pause", "resume", "promote", "history"):
        assert parser.parse_args(["rollout", verb, "web"]).func is not None


DOC = """
name: web
kind: process
command: sleep 1
replicas: 8
{update}
"""


@pytest.mark.parametrize(
    ("update", "want"),
    [
        ("update: {maxSurge: 25%, maxUnavailable: 25%}", (2, 2, 0, 600)),
        ("update: {max_surge: 0, max_unavailable: 1, min_ready_seconds: 5}", (0, 1, 5, 600)),
        ("update: {progressDeadlineSeconds: 2m, minReadySeconds: 10s}", (1, 0, 10, 120)),
        ("update: {maxSurge: 5%, maxUnavailable: 5%}", (1, 0, 0, 600)),  # both round to 0
        ("", (1, 0, 0, 600)),
    ],
    ids=["percent", "snake", "durations", "tiny-percent", "defaults"],
)
def test_manifest_update_in_either_case(update: str, want: tuple[int, int, int, int]) -> None:
    u = parse_manifests(DOC.format(update=update))[0].update
    assert (u.max_surge, u.max_unavailable, u.min_ready_seconds, u.progress_deadline_seconds) == (
        want
    )


@pytest.mark.parametrize(
    ("update", "error"),
    [
        ("update: {maxSurge: 0}", "update.max_surge: must be at least 1"),
        ("update: {surge: 1}", "update: unknown key 'surge'"),
        ("update: {maxSurge: 150%}", "update.max_surge: '150%' is not a percentage"),
        ("update: {minReadySeconds: 1.5s}", "must be whole seconds"),
    ],
)
def test_manifest_update_errors_name_the_field(update: str, error: str) -> None:
    with pytest.raises(Invalid, match=error.replace(".", r"\.").replace("(", r"\(")):
        parse_manifests(DOC.format(update=update))
