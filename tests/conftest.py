"""Fixtures shared by every test layer."""

from __future__ import annotations

import asyncio
import signal
import sys
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
