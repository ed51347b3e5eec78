"""`orka top nodes` in table, json and yaml, through the command (the client is a fake)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from orka.cli import top
from orka.cli.main import main
from orka.models import Node, NodeState, Resources

GI = 1 << 30

NODES = [
    Node(
        name="node-b",
        allocatable=Resources(cpu_millis=4000, memory_bytes=8 * GI),
        allocated=Resources(cpu_millis=1500, memory_bytes=2 * GI),
        usage=Resources(cpu_millis=1000, memory_bytes=6 * GI),
        instance_count=3,
    ),
    Node(
        name="node-a",
        state=NodeState.NOT_READY,
        allocatable=Resources(cpu_millis=2000, memory_bytes=4 * GI),
        usage=Resources(cpu_millis=1500, memory_bytes=1 * GI),
        instance_count=1,
    ),
]


class FakeClient:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def list_nodes(self) -> list[Node]:
        return list(NODES)


@pytest.fixture(autouse=True)
def fake_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("ORKA_CONTROLLER", "ORKA_CERTS", "ORKA_DATA_DIR", "ORKA_OUTPUT", "ORKA_SORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORKA_CLI_ENV", str(tmp_path / "no-cli.env"))
    monkeypatch.setattr(top, "AdminClient", FakeClient)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["top", "nodes", *argv]) == 0
    return capsys.readouterr().out


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    header, a, b = run(capsys).splitlines()
    assert header.split() == [
        "NAME",
        "STATE",
        "CPU",
        "CPU%",
        "CPU-ALLOCATED",
        "MEMORY",
        "MEMORY%",
        "MEMORY-ALLOCATED",
        "INSTANCES",
    ]
    assert a.split() == ["node-a", "NOT_READY", "1500m/2", "75%", "0", "1Gi/4Gi", "25%", "0", "1"]
    assert b.split() == ["node-b", "READY", "1/4", "25%", "1500m", "6Gi/8Gi", "75%", "2Gi", "3"]
    # Columns line up.
    assert header.index("CPU%") == a.index("75%") == b.index("25%")


def test_sort_by_cpu_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert [r.split()[0] for r in run(capsys, "--sort", "cpu").splitlines()[1:]] == [
        "node-a",
        "node-b",
    ]
    assert [r.split()[0] for r in run(capsys, "--sort", "memory").splitlines()[1:]] == [
        "node-b",
        "node-a",
    ]


EXPECTED_B = {
    "name": "node-b",
    "state": "READY",
    "cpu_usage_millis": 1000,
    "cpu_allocated_millis": 1500,
    "cpu_allocatable_millis": 4000,
    "cpu_usage_percent": 25.0,
    "memory_usage_bytes": 6 * GI,
    "memory_allocated_bytes": 2 * GI,
    "memory_allocatable_bytes": 8 * GI,
    "memory_usage_percent": 75.0,
    "instances": 3,
}


def test_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(run(capsys, "-o", "json"))
    assert [d["name"] for d in data] == ["node-a", "node-b"]
    assert data[1] == EXPECTED_B
    assert data[0]["cpu_usage_percent"] == 75.0 and data[0]["state"] == "NOT_READY"


def test_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load(run(capsys, "-o", "yaml"))
    assert data[1] == EXPECTED_B
    assert data[0]["memory_usage_percent"] == 25.0


def test_node_offering_nothing_has_no_percentage() -> None:
    text = top.render([Node(name="empty", usage=Resources(cpu_millis=5))], "table")
    row = text.splitlines()[1].split()
    assert row[:4] == ["empty", "READY", "5m/0", "<none>"]
    assert top.rows([Node(name="empty")])[0].cpu_usage_percent is None


def test_no_nodes() -> None:
    assert top.render([], "table") == "No nodes found."
    assert json.loads(top.render([], "json")) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["top", "pods"], "only nodes"),
        (["top", "nodes", "-o", "xml"], "-o/--output"),
        (["top", "nodes", "--sort", "age"], "--sort"),
    ],
)
def test_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
