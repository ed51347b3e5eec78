"""The benchmarks at tiny sizes, so the scripts cannot rot. No timing is asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.bench
@pytest.mark.timeout(180)
def test_run_all_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run_all.py"), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    summary = json.loads(last)
    assert summary["bench"] == "all" and summary["failed"] == []
    assert {"machine", "results", "ratios", "targets"} <= summary.keys()
    results = summary["results"]
    assert set(results) == {"echo", "decisions", "placement", "heartbeat", "healing"}
    assert results["echo"]["messages_per_s"] > 0
    assert set(results["decisions"]["results"]) == {"spread", "binpack"}
    assert {"running_per_s", "scheduled_per_s", "p99_create_to_running_s"} <= set(
        results["placement"]["sqlite"]
    )
    assert "etcd" in results["placement"]
    assert {
        "false_not_ready",
        "scheduler_cpu_share",
        "scheduler_peak_rss_mib",
        "heartbeats_per_s",
    } <= set(results["heartbeat"])
    assert "kill_to_all_running_elsewhere_s" in results["healing"]
