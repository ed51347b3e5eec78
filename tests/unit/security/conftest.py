from __future__ import annotations

from pathlib import Path

import pytest

from orka.security.issue import init_certs


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A cluster's certificates: the CA, its services, an admin and the agent of node-1."""
    d = tmp_path / "certs"
    init_certs(d, ["node-1"])
    return d
