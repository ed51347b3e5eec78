"""Exec health checks of processes (ProcessDriver.check_exec) run as the instance does: its
user, working dir, environment and cgroup; their output is bounded and a check cancelled at its
timeout leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orka.errors import NotFound
from orka.runtime.base import MAX_CHECK_OUTPUT
from orka.runtime.process import ProcessDriver
from tests.cgroups import detect_mounts

from .conftest import _kill_leftovers, run_spec

CGROUP_VERSION, _ = detect_mounts() if os.geteuid() == 0 else (0, [])
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or CGROUP_VERSION == 0,
    reason="needs root and a writable memory+cpu cgroup hierarchy, as a production agent has",
)
NOBODY = 65534


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    # Traversable by nobody (pytest's tmp dirs are root's 0700).
    path = Path(tempfile.mkdtemp(prefix="orka-check-exec-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    _kill_leftovers(path / "process")
    shutil.rmtree(path, ignore_errors=True)


async def test_a_check_runs_in_the_instances_context(cgroup_parent: str, outside_tmp: Path) -> None:
    driver = ProcessDriver(outside_tmp / "process", poll_interval=0.05, cgroup_parent=cgroup_parent)
    spec = run_spec(env={"GREETING": "hello"})
    try:
        await driver.start(spec)
        assert driver.cgroups is not None
        script = 'id -u; pwd; echo "$ORKA_INSTANCE $GREETING"; cat /proc/self/cgroup'
        code, output = await driver.check_exec("web-0", spec.spec, ["sh", "-c", script])
        uid, cwd, env, *cgroups = output.splitlines()
        work = str(outside_tmp / "process" / "work" / "web-0")
        assert (code, uid, cwd, env) == (0, str(NOBODY), work, "web-0 hello")
        # In the instance's own cgroup (memory and cpu), where its limits hold.
        assert sum("/web-0" in line for line in cgroups) >= 1, cgroups

        assert await driver.check_exec("web-0", spec.spec, ["sh", "-c", "exit 3"]) == (3, "")
        code, output = await driver.check_exec(
            "web-0", spec.spec, ["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x"]
        )
        assert (code, output) == (0, "x" * MAX_CHECK_OUTPUT)

        # At its timeout the check is cancelled: its command and what it started are killed.
        marker = "sleep\x00123.456"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                driver.check_exec(
                    "web-0", spec.spec, ["sh", "-c", "sleep 123.456 & sleep 123.456"]
                ),
                0.5,
            )
        assert await _gone(marker) == []
    finally:
        await driver.remove("web-0")
        await driver.close()
    with pytest.raises(NotFound):
        await driver.check_exec("web-0", spec.spec, ["true"])


async def _gone(marker: str, timeout: float = 10.0) -> list[Path]:
    """The processes whose command line starts with `marker` once they have all gone, or
    those left after `timeout`: a killed process stays in /proc until the kernel has torn it
    down."""
    deadline = time.monotonic() + timeout
    while True:
        left = await asyncio.to_thread(_running, marker)
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.05)


def _running(marker: str) -> list[Path]:
    return [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p).startswith(marker)]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
