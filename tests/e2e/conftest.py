"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.procs import ProcessCluster
from tests.etcd import EtcdCluster


@pytest.fixture
async def fake_cluster(
    certs_dir: Path, tmp_path: Path, etcd: EtcdCluster, etcd_prefix: str
) -> AsyncIterator[ProcessCluster]:
    """Services as OS processes on the shared etcd (a prefix of the test's own), agents with
    the fake driver; nothing started yet. Its services' logs are printed when the test fails."""
    c = ProcessCluster(certs_dir, tmp_path, store_url=etcd.url + etcd_prefix, runtime="fake")
    try:
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        for svc in c.services.values():
            if svc.proc is not None and svc.proc.poll() is None:
                svc.signal(signal.SIGCONT)  # a stopped process cannot be killed cleanly
        await c.close()
