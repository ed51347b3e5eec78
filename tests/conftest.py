"""Fixtures shared by every test layer."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orka.security.issue import init_certs
from tests.etcd import ETCD, EtcdCluster

NODES = [f"node-{i}" for i in range(1, 7)]


@pytest.fixture(scope="session")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cluster CA with service, admin and agent certs, shared by the whole run."""
    path = tmp_path_factory.mktemp("certs")
    init_certs(path, nodes=NODES)
    return path


def _dump_tasks(signum: int, frame: object) -> None:
    """SIGUSR1 prints every asyncio task's stack: how a hung async test is diagnosed."""
    loop = asyncio._get_running_loop()
    if loop is None:
        return
    for task in asyncio.all_tasks(loop):
        try:
            task.print_stack(file=sys.stderr)
        except Exception as err:  # frames of compiled code have no line numbers
            print(f"{task!r}: {err!r}", file=sys.stderr)


signal.signal(signal.SIGUSR1, _dump_tasks)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One real etcd member for the whole run; tests keep apart by key prefix (`etcd_prefix`)."""
    if not ETCD.exists():
        pytest.skip(f"{ETCD} missing (install Debian's etcd-server)")
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1) as cluster:
        yield cluster


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix of its own for each test on the shared etcd."""
    return f"/test-{uuid.uuid4().hex[:12]}"
