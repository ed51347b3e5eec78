"""The short chaos soak: every part a real process, faults at random, invariants checked.

A 3-member etcd, two controllers, the schedulers and five agents running real processes; users
create, scale and delete workloads while SIGKILLs, SIGSTOPs and partitions hit random members
for `SOAK_SECONDS`. Any violation the checker records fails the test (see
tests/chaos/invariants.py for the rules); `bench/bench_chaos.py` runs the long soak.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.soak import SoakConfig, soak
from tests.etcd import needs_etcd

pytestmark = [pytest.mark.e2e, needs_etcd]

SOAK_SECONDS = float(os.environ.get("ORKA_CHAOS_SECONDS", "100"))


async def test_chaos_soak(certs_dir: Path, tmp_path: Path) -> None:
    seed = int(os.environ.get("ORKA_CHAOS_SEED", "1"))
    report = await soak(certs_dir, tmp_path, SoakConfig(seconds=SOAK_SECONDS, seed=seed))
    print("\n".join(report.lines()))
    assert report.violations == [], "\n".join(report.lines())
    assert report.converged_after is not None
    # The soak did what it is for: faults of every kind on every role it may hit, and users
    # whose requests were acknowledged through them.
    kinds = {key.split()[0] for key in report.faults}
    assert {"kill", "pause"} <= kinds, report.faults
    assert sum(report.faults.values()) >= 10, report.faults
    assert report.requests.get("ok", 0) >= 50, report.requests
