"""`orka up --metrics-port`: each child gets its own loopback metrics port."""

from __future__ import annotations

from pathlib import Path

import pytest

from orka.cli.main import main
from orka.cli.up import Cluster


def _flag(argv: list[str]) -> str | None:
    return argv[argv.index("--metrics-listen") + 1] if "--metrics-listen" in argv else None


def test_ports_from_the_first_one_up(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 2, "127.0.0.1:7443", "127.0.0.1:7444", metrics_port=9100)
    assert {ch.name: _flag(ch.argv) for ch in c.children} == {
        "scheduler": "127.0.0.1:9100",
        "controller": "127.0.0.1:9101",
        "node-1": "127.0.0.1:9102",
        "node-2": "127.0.0.1:9103",
    }
    assert c.metrics == {"scheduler": 9100, "controller": 9101, "node-1": 9102, "node-2": 9103}


def test_off_by_default(tmp_path: Path) -> None:
    c = Cluster(tmp_path, 1, "127.0.0.1:7443", "127.0.0.1:7444")
    assert [_flag(ch.argv) for ch in c.children] == [None, None, None]


def test_port_range_checked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["up", "--data-dir", str(tmp_path), "--agents", "2", "--metrics-port", "65534"]
    assert main(argv) == 2
    assert "--metrics-port: 65534 leaves no room" in capsys.readouterr().err
