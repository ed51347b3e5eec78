"""`orka get -w` against a scripted client: each change printed once (the revision rule), other
kinds and filtered-out objects skipped, and OUT_OF_RANGE lists again and resumes."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orka.cli import resources
from orka.cli.client import WatchedChange
from orka.errors import OutOfRange
from orka.models import Instance, InstancePhase, Node, NodeState


def inst(name: str, phase: InstancePhase, node: str = "n1") -> Instance:
    return Instance(name=name, workload="web", phase=phase, node=node)


class Script:
    """Listings and watch streams handed out in order; a stream is changes then an error."""

    def __init__(self, lists: list[Any], streams: list[Any]) -> None:
        self.lists = lists
        self.streams = streams
        self.since: list[int] = []

    async def __aenter__(self) -> Script:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def list_at(self, kind: str, **filters: Any) -> tuple[list[Any], int]:
        if not self.lists:
            raise KeyboardInterrupt  # the end of the script: as Ctrl-C ends a real watch
        return self.lists.pop(0)

    async def watch(self, since: int, workload: str = "") -> AsyncIterator[WatchedChange]:
        self.since.append(since)
        if not self.streams:
            raise KeyboardInterrupt  # the end of the script: as Ctrl-C ends a real watch
        changes, end = self.streams.pop(0)
        for c in changes:
            yield c
        if end is not None:
            raise end


def args(**kw: Any) -> argparse.Namespace:
    base = {
        "resource": "instances",
        "name": None,
        "output": "table",
        "workload": "",
        "node": "",
        "phase": None,
        "output_watch_events": True,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def change(type_: str, obj: Any, rev: int) -> WatchedChange:
    kind = "instance" if isinstance(obj, Instance) else "node"
    return WatchedChange(type_, kind, obj, rev)


def run(monkeypatch: pytest.MonkeyPatch, capsys: Any, script: Script, **kw: Any) -> list[list[str]]:
    monkeypatch.setattr(resources, "_client", lambda a: script)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(resources._watch(args(**kw)))
    return [line.split()[:5] for line in capsys.readouterr().out.splitlines()[1:]]


def test_each_change_once_other_kinds_and_filtered_objects_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    a = inst("web-1", InstancePhase.SCHEDULED)
    script = Script(
        lists=[([(12, a)], 10)],
        streams=[
            (
                [
                    change("ADDED", a, 12),  # the list already holds it at this revision
                    change("ADDED", Node(name="n1", state=NodeState.READY), 13),
                    change("MODIFIED", inst("web-1", InstancePhase.RUNNING), 14),
                    change("ADDED", inst("web-2", InstancePhase.PENDING, "n2"), 15),
                ],
                None,
            )
        ],
    )
    rows = run(monkeypatch, capsys, script, node="n1")
    assert rows == [
        ["ADDED", "web-1", "web", "n1", "SCHEDULED"],
        ["MODIFIED", "web-1", "web", "n1", "RUNNING"],
    ]
    assert script.since[0] == 10


def test_out_of_range_lists_again_and_resumes_from_the_new_list(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    a = inst("web-1", InstancePhase.PENDING, "")
    b = inst("web-2", InstancePhase.RUNNING)
    script = Script(
        lists=[
            ([(5, a), (6, b)], 6),
            # Relisted: web-1 changed meanwhile, web-2 was deleted, web-3 came.
            (
                [
                    (30, inst("web-1", InstancePhase.RUNNING)),
                    (31, inst("web-3", InstancePhase.PENDING)),
                ],
                31,
            ),
        ],
        streams=[([], OutOfRange("too old"))],
    )
    rows = run(monkeypatch, capsys, script)
    assert rows == [
        ["ADDED", "web-1", "web", "<none>", "PENDING"],
        ["ADDED", "web-2", "web", "n1", "RUNNING"],
        ["DELETED", "web-2", "web", "n1", "RUNNING"],
        ["MODIFIED", "web-1", "web", "n1", "RUNNING"],
        ["ADDED", "web-3", "web", "n1", "PENDING"],
    ]
    assert script.since == [6, 31]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["get", "endpoints", "web", "-w"], "endpoints cannot be watched"),
        (["get", "instances", "--output-watch-events"], "only with -w/--watch"),
    ],
)
def test_watch_usage_errors_before_any_connection(argv: list[str], words: str, capsys: Any) -> None:
    from orka.cli.main import EXIT_USAGE, main

    assert main([*argv, "--controller", "127.0.0.1:1"]) == EXIT_USAGE
    assert words in capsys.readouterr().err
