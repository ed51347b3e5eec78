"""An agent whose scheduler is down: while the scheduler's port refuses connections the agent
only probes it (no TLS channel, no dial, no log line per attempt), and registers as soon as a
scheduler listens there again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog.testing

from orka.agent.service import Agent, AgentConfig
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles
from tests.etcd import free_port
from tests.integration.cluster import eventually


async def test_an_agent_does_not_dial_a_refusing_scheduler_and_registers_when_it_listens(
    certs_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    agent = Agent(
        AgentConfig(
            name="node-2",
            schedulers=[f"127.0.0.1:{port}"],
            data_dir=tmp_path / "node-2",
            runtimes=["fake"],
            reconnect_max=0.2,  # pauses shorter than a probe interval: each ends refused
        ),
        TlsFiles.for_service(certs_dir, "agent", "node-2"),
    )
    scheduler = Scheduler(
        SchedulerConfig(listen=f"127.0.0.1:{port}"),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    with structlog.testing.capture_logs() as logs:
        try:
            await agent.start()
            # Long enough for ten dials at 0.1-0.2 s pauses, had each pause ended in one.
            await asyncio.sleep(1.5)
            dials = [e for e in logs if e["event"] == "scheduler stream ended"]
            # The first dial, and at most one more made anyway after ten left out.
            assert 1 <= len(dials) <= 2, dials
            assert {e["code"] for e in dials} == {"UNAVAILABLE"}
            await scheduler.start()
            await asyncio.wait_for(agent.connected.wait(), 10)
            await eventually(
                lambda: asyncio.sleep(0, [n.name for n in scheduler.registry] == ["node-2"]), 10
            )
        finally:
            await agent.stop()
            await scheduler.stop()
