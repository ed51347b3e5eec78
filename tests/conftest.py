"""Fixtures shared by every test layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from orka.security.issue import init_certs

NODES = [f"node-{i}" for i in range(1, 7)]


@pytest.fixture(scope="session")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cluster CA with service, admin and agent certs, shared by the whole run."""
    path = tmp_path_factory.mktemp("certs")
    init_certs(path, nodes=NODES)
    return path
