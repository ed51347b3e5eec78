"""End to end, the scheduler and the agent as processes: when one of a service's parts fails,
the process logs one line naming the part and the error, stops and exits 1 (never half alive).

No input makes a part fail on purpose, so the process is `orka scheduler` (or `orka agent`)
started through a small launcher that breaks one part first (the test's code, not the
product's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.procs import free_port

pytestmark = pytest.mark.e2e

LAUNCHER = """
import sys
from orka.scheduler.liveness import Liveness

def check(self, now):
    raise RuntimeError("liveness pass broke")

Liveness.check = check
from orka.cli.main import main
sys.exit(main(sys.argv[1:]))
"""

AGENT_LAUNCHER = """
import asyncio, sys
from orka.agent.stream import Stream

async def run(self):
    await asyncio.sleep(0.1)
    raise RuntimeError("stream loop broke")

Stream.run = run
from orka.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _run_broken(
    launcher: str, args: list[str]
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """Run `orka ARGS` through a launcher that breaks one part; its exit and its JSON log lines."""
    proc = subprocess.run(
        [sys.executable, "-c", launcher, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ORKA_LOG_LEVEL": "info"},
    )
    assert proc.returncode == 1, proc.stderr
    return proc, [json.loads(line) for line in proc.stderr.splitlines() if line[:1] == "{"]


def _failures(lines: list[dict]) -> list[tuple[str, str, str, str]]:
    return [
        (e["event"], e["service"], e["part"], e["error"]) for e in lines if e["level"] == "error"
    ]


def test_a_scheduler_whose_part_fails_exits_1_with_one_log_line(
    certs_dir: Path, tmp_path: Path
) -> None:
    proc, lines = _run_broken(
        LAUNCHER,
        [
            "scheduler",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--certs",
            str(certs_dir),
            "--data-dir",
            str(tmp_path),
            "--heartbeat-interval",
            "0.2",
            "--node-lost-after",
            "1",
        ],
    )
    assert _failures(lines) == [
        (
            "service part failed; stopping the service",
            "scheduler",
            "liveness",
            "RuntimeError: liveness pass broke",
        )
    ]
    errors = [e for e in lines if e["level"] == "error"]
    assert "RuntimeError: liveness pass broke" in errors[0]["exception"]  # the traceback
    assert [e["event"] for e in lines].index("scheduler listening") < lines.index(errors[0])
    assert proc.stderr.splitlines()[-1] == (
        "error: scheduler: its liveness failed (RuntimeError: liveness pass broke); stopped"
    )


def test_an_agent_whose_part_fails_exits_1_with_one_log_line(
    certs_dir: Path, tmp_path: Path
) -> None:
    proc, lines = _run_broken(
        AGENT_LAUNCHER,
        [
            "agent",
            "--name",
            "node-1",
            "--scheduler",
            f"127.0.0.1:{free_port()}",
            "--certs",
            str(certs_dir),
            "--data-dir",
            str(tmp_path),
            "--runtime",
            "fake",
        ],
    )
    assert _failures(lines) == [
        (
            "service part failed; stopping the service",
            "agent/node-1",
            "stream",
            "RuntimeError: stream loop broke",
        )
    ]
    assert "agent stopped" in [e["event"] for e in lines]
    assert proc.stderr.splitlines()[-1] == (
        "error: agent: its stream failed (RuntimeError: stream loop broke); stopped"
    )
