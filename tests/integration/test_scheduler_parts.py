"""The scheduler as one supervised whole: a part that fails stops all of it, with one log line
naming the part and the error, and the server stops serving (no half-alive scheduler)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orka.rpc.client import secure_channel
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles
from orka.supervision import PartFailed
from tests.integration.test_scheduler_nodes import HandAgent, until


class BreakingClock:
    """The liveness clock (the scheduler's `clock` parameter) that fails once told to."""

    def __init__(self) -> None:
        self.broken = False

    def __call__(self) -> float:
        if self.broken:
            raise RuntimeError("clock stopped")
        return time.monotonic()


async def _health(port: int, certs: Path) -> str:
    tls = TlsFiles.for_service(certs, "controller", "controller")
    async with secure_channel(f"127.0.0.1:{port}", tls, "scheduler") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_a_failing_part_stops_the_scheduler_with_one_log_line(certs_dir: Path) -> None:
    clock = BreakingClock()
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0", heartbeat_interval=0.2, node_lost_after=1.0),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
        clock=clock,
    )
    with structlog.testing.capture_logs() as logs:
        runner = asyncio.create_task(s.run())
        await until(lambda: s.port)
        assert await _health(s.port, certs_dir) == "SERVING"
        # An agent connected when it fails: its stream ends too.
        agent = HandAgent(s, certs_dir, "node-1")
        await agent.register()
        clock.broken = True
        with pytest.raises(PartFailed) as failed:
            await asyncio.wait_for(runner, 10)
    # The agent's stream was ended (EOF), not left open to a scheduler that no longer runs.
    assert agent.task is not None
    await asyncio.wait_for(agent.task, 5)
    await agent.close()
    assert (failed.value.service, failed.value.part) == ("scheduler", "liveness")
    assert (
        str(failed.value) == "scheduler: its liveness failed (RuntimeError: clock stopped); stopped"
    )
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [(e["event"], e["part"], e["error"]) for e in errors] == [
        (
            "service part failed; stopping the service",
            "liveness",
            "RuntimeError: clock stopped",
        )
    ]
    assert isinstance(errors[0]["exc_info"], RuntimeError)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _health(s.port, certs_dir)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_a_stopped_scheduler_reports_no_part_failure(certs_dir: Path) -> None:
    """Stopping cancels the parts: that is no failure, and run() returns."""
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0"),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    with structlog.testing.capture_logs() as logs:
        runner = asyncio.create_task(s.run())
        await until(lambda: s.port)
        await s.stop()
        await asyncio.wait_for(runner, 10)
    assert [e for e in logs if e["log_level"] == "error"] == []
    assert all(t.done() for t in s.parts.tasks.values())


def test_offers_wait_out_the_lag_liveness_measures(certs_dir: Path) -> None:
    # The placer's offers are excused by how late the scheduler reads its streams
    # (session.replies); that figure is the liveness clock's, for every term's parts.
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0"),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    assert s.placer.behind == s.liveness.lag
    s._build()  # a new term's parts
    assert s.placer.behind == s.liveness.lag
