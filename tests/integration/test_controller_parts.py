"""The leading controller as one supervised whole: a leader part (reconciler, placement queue,
volume keeper) that ends while the term runs stops the controller with one log line naming it;
it never goes on answering the API as a leader that no longer acts."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from orka.supervision import PartFailed
from tests.integration.cluster import Cluster


async def test_a_leader_part_cancelled_from_outside_stops_the_controller(cluster: Cluster) -> None:
    controller = cluster.controller
    assert controller is not None
    reconciler = next(t for t in controller._tasks if t.get_name() == "reconciler")
    with structlog.testing.capture_logs() as logs:
        # What grpc.aio did to a call in flight when its channel was closed (the chaos soak):
        # the task ends cancelled although nobody asked the controller to stop.
        reconciler.cancel()
        with pytest.raises(PartFailed) as failed:
            await asyncio.wait_for(controller.run(), 10)
    assert str(failed.value) == (
        "controller: its reconciler failed (CancelledError: cancelled while leading); stopped"
    )
    errors = [(e["event"], e["task"]) for e in logs if e["log_level"] == "error"]
    assert errors == [("controller task failed", "reconciler")]
