"""A spec that fails at start costs next to nothing: its instances are re-placed with
backoff, on a real cluster (controller, scheduler and agents on grpc.aio servers)."""

from __future__ import annotations

import asyncio
import time

import pytest

from orka.api import controller_pb2 as pb
from tests.integration.cluster import Cluster

WINDOW = 6.0


@pytest.fixture
def cluster_agents() -> int:
    return 2


async def test_a_spec_failing_at_start_is_retried_with_backoff(cluster: Cluster) -> None:
    assert cluster.api is not None
    # The fake driver refuses this env at start with an error its supervisor does not retry
    # (like a spec no node can run): the instance ends FAILED and the controller replaces it.
    spec = pb.WorkloadSpec(
        name="broken",
        kind=pb.WorkloadSpec.PROCESS,
        command=["x"],
        env={"FAKE_EXIT_AFTER": "soon"},
        replicas=1,
    )
    created: list[str] = []
    failed: dict[str, float] = {}  # instance -> when its FAILED event came
    added_at: list[float] = []
    stream = cluster.api.WatchEvents(pb.WatchEventsRequest(workload="broken"))

    async def watch() -> None:
        async for ev in stream:
            if ev.HasField("instance"):
                if ev.type == pb.Event.ADDED:
                    created.append(ev.instance.name)
                    added_at.append(time.monotonic())
                if ev.instance.phase == pb.Instance.FAILED:
                    failed.setdefault(ev.instance.name, time.monotonic())

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.sleep(0.3)
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
        await asyncio.sleep(WINDOW)
    finally:
        watcher.cancel()
    # Backoff 1, 2, 4 s after each failure: the first instance and at most three replacements
    # in the window (with none it was hundreds), and it does keep trying.
    assert 3 <= len(created) <= 5, created
    assert len(failed) >= 3
    # Each replacement came the backoff (1 s, then 2 s) after its predecessor failed: not
    # sooner, and not much later (the reconciler wakes for it).
    for i, backoff in enumerate([1.0, 2.0]):
        waited = added_at[i + 1] - failed[created[i]]
        assert backoff - 0.2 <= waited <= backoff + 0.5, (i, waited)
