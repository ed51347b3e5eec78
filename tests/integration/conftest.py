"""Fixtures the integration tests share; a test module defining its own `cluster` overrides it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster


@pytest.fixture
def cluster_agents() -> int:
    """How many agents `cluster` starts; a module needing more overrides just this."""
    return 1


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path, cluster_agents: int) -> AsyncIterator[Cluster]:
    """Controller, scheduler and `cluster_agents` agents with the fake runtime, in this process."""
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start(agents=cluster_agents, runtimes=["fake"])
        yield c
    finally:
        await c.stop()
