"""Fixtures the integration tests share; a test module defining its own `cluster` overrides it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    """Controller, scheduler and one agent with the fake runtime, in this process."""
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start(agents=1, runtimes=["fake"])
        yield c
    finally:
        await c.stop()
