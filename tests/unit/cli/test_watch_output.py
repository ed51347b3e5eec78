"""`orka get -w` rendering: the listed table, then one aligned row (or document) per change."""

from __future__ import annotations

import json

import yaml

from orka.cli import output
from orka.cli.client import Activity
from orka.models import Instance, InstancePhase

NOW = 1_000_000.0


def inst(name: str, phase: InstancePhase = InstancePhase.PENDING, node: str = "") -> Instance:
    return Instance(name=name, workload="web", phase=phase, node=node, created_at=NOW - 5)


def test_table_rows_follow_the_first_tables_columns_without_a_header() -> None:
    p = output.WatchPrinter("instances", "table")
    first = p.listed([inst("web-1")], NOW).splitlines()
    assert first[0].split()[:4] == ["NAME", "WORKLOAD", "NODE", "PHASE"]
    assert len(first) == 2
    row = p.change(inst("web-1", InstancePhase.RUNNING, "node-1"), "MODIFIED", NOW)
    assert "\n" not in row and "NAME" not in row
    assert row.split()[:4] == ["web-1", "web", "node-1", "RUNNING"]
    # The PHASE column starts where the header's did.
    assert row.index("RUNNING") == first[0].index("PHASE")


def test_an_empty_list_still_prints_the_header_for_the_rows_to_come() -> None:
    p = output.WatchPrinter("nodes", "table")
    assert p.listed([], NOW).split()[:2] == ["NAME", "STATE"]


def test_watch_events_add_an_event_column_and_mark_deletions() -> None:
    p = output.WatchPrinter("instances", "table", events=True)
    head = p.listed([inst("web-1")], NOW).splitlines()
    assert head[0].split()[:2] == ["EVENT", "NAME"]
    assert head[1].split()[:2] == ["ADDED", "web-1"]
    assert p.change(inst("web-1"), "DELETED", NOW).split()[:2] == ["DELETED", "web-1"]


def test_json_is_one_document_per_change() -> None:
    p = output.WatchPrinter("instances", "json", events=True)
    doc = json.loads(p.change(inst("web-2", InstancePhase.RUNNING, "n"), "MODIFIED"))
    assert doc["type"] == "MODIFIED"
    assert doc["object"]["name"] == "web-2" and doc["object"]["phase"] == "RUNNING"
    plain = output.WatchPrinter("instances", "json")
    assert json.loads(plain.change(inst("web-3"), "ADDED"))["name"] == "web-3"


def test_yaml_documents_are_separated() -> None:
    p = output.WatchPrinter("instances", "yaml")
    text = "\n".join(
        [p.listed([inst("web-1"), inst("web-2")]), p.change(inst("web-1", node="n"), "MODIFIED")]
    )
    docs = list(yaml.safe_load_all(text))
    assert [d["name"] for d in docs] == ["web-1", "web-2", "web-1"]
    assert docs[2]["node"] == "n"
    assert not text.startswith("---")


# ---- describe: the activity section ----

ACTS = [
    Activity(
        type="Warning",
        reason="Restarted",
        message="exited with code 3; restarted",
        count=4,
        first_at=NOW - 120,
        last_at=NOW - 10,
    ),
    Activity(
        type="Normal",
        reason="Scheduled",
        message="placed on n2; 1 node passed over: 1 node: cordoned",
        first_at=NOW - 200,
        last_at=NOW - 200,
    ),
]


def test_activity_section_lists_oldest_first_with_repeats_counted() -> None:
    lines = output.activity_section(ACTS, NOW).splitlines()
    assert lines[0] == "Activity:"
    assert lines[1].split() == ["AGE", "TYPE", "REASON", "MESSAGE"]
    assert lines[2].split()[:3] == ["3m20s", "Normal", "Scheduled"]
    assert lines[3].split()[:6] == ["10s", "(x4", "over", "2m)", "Warning", "Restarted"]
    assert lines[3].endswith("exited with code 3; restarted")
    assert output.activity_section([], NOW) == "Activity:  <none>"


def test_describe_documents_carry_the_activities_as_a_list() -> None:
    i = inst("web-1", InstancePhase.RUNNING, "n2")
    doc = json.loads(output.describe_document(i, ACTS, "json"))
    assert doc["name"] == "web-1"
    assert [a["reason"] for a in doc["activities"]] == ["Restarted", "Scheduled"]
    assert doc["activities"][0]["count"] == 4
    assert doc["activities"][0]["last_time"] == "1970-01-12T13:46:30Z"
    y = yaml.safe_load(output.describe_document(i, ACTS, "yaml"))
    assert y["activities"][1]["message"].startswith("placed on n2")
