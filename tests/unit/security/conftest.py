from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orka.security.issue import init_certs


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A cluster's certificates: the CA, its services, an admin and the agent of node-1."""
    d = tmp_path / "certs"
    init_certs(d, ["node-1"])
    return d


@pytest.fixture(params=["Etc/GMT-12", "Etc/GMT+12"])
def off_utc(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The process in a time zone twelve hours either side of UTC, for what dates itself."""
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()
