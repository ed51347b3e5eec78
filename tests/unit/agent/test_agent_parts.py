"""The agent as one supervised whole: when its stream part fails, the whole agent stops (its
instances with it), says so in one log line, and run() raises why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from orka.agent.service import Agent, AgentConfig
from orka.agent.stream import Stream
from orka.models import InstancePhase, WorkloadKind, WorkloadSpec
from orka.security.tls import TlsFiles
from orka.supervision import PartFailed


class BrokenStream(Stream):
    """A stream whose loop dies of a bug once the agent is up."""

    async def run(self) -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("stream broke")


class BrokenAgent(Agent):
    stream_class = BrokenStream


async def started(agent: Agent) -> None:
    """Wait until run() has started the agent's parts, the stream last: past its start-up
    (re-adopting volumes and instances), whose own state saves would replace a test's."""
    for _ in range(1000):
        if "stream" in agent.parts.tasks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the agent's parts never started")


def config(tmp_path: Path) -> AgentConfig:
    return AgentConfig(
        name="node-1", schedulers=["127.0.0.1:1"], data_dir=tmp_path / "agent", runtimes=["fake"]
    )


async def test_a_failing_stream_stops_the_whole_agent(tmp_path: Path, certs_dir: Path) -> None:
    agent = BrokenAgent(config(tmp_path), TlsFiles.for_service(certs_dir, "agent", "node-1"))
    with structlog.testing.capture_logs() as logs:
        runner = asyncio.create_task(agent.run())
        await started(agent)
        # Something runs here when it fails: it is stopped, not left behind.
        spec = WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["sleep", "100"])
        inst = agent.runner.new_instance("web-1", 1, spec, agent.healthy["fake"])
        inst.start()
        with pytest.raises(PartFailed) as failed:
            await asyncio.wait_for(runner, 10)
    assert (failed.value.service, failed.value.part) == ("agent", "stream")
    assert str(failed.value) == "agent: its stream failed (RuntimeError: stream broke); stopped"
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [(e["event"], e["part"], e["error"]) for e in errors] == [
        (
            "service part failed; stopping the service",
            "stream",
            "RuntimeError: stream broke",
        )
    ]
    assert inst.phase is InstancePhase.STOPPED
    assert agent.instances == {}
    assert "agent stopped" in [e["event"] for e in logs]


async def test_a_stopped_agent_reports_no_failure(tmp_path: Path, certs_dir: Path) -> None:
    agent = Agent(config(tmp_path), TlsFiles.for_service(certs_dir, "agent", "node-1"))
    with structlog.testing.capture_logs() as logs:
        runner = asyncio.create_task(agent.run())
        await started(agent)
        agent.request_stop(leave=False)
        await asyncio.wait_for(runner, 10)
    assert [e for e in logs if e["log_level"] == "error"] == []
    assert all(t.done() for t in agent.parts.tasks.values())


async def test_a_state_file_writer_that_dies_stops_the_agent(
    tmp_path: Path, certs_dir: Path
) -> None:
    """Saves that silently stopped being written would leave a restarted agent with an old
    picture: the writer is a supervised part too."""
    agent = Agent(config(tmp_path), TlsFiles.for_service(certs_dir, "agent", "node-1"))

    def broken() -> str:
        raise RuntimeError("cannot encode the state")

    with structlog.testing.capture_logs() as logs:
        runner = asyncio.create_task(agent.run())
        await started(agent)
        agent.state_file.save(broken)
        with pytest.raises(PartFailed) as failed:
            await asyncio.wait_for(runner, 10)
    assert failed.value.part == "state file"
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [(e["event"], e["part"], e["error"]) for e in errors] == [
        (
            "service part failed; stopping the service",
            "state file",
            "RuntimeError: cannot encode the state",
        )
    ]


async def test_a_part_cancelled_from_outside_stops_the_agent(
    tmp_path: Path, certs_dir: Path
) -> None:
    """A part's task ended by a cancellation nobody asked the service for (grpc.aio cancels
    the calls of a closed channel) is a part gone: the service stops, it does not go on half
    alive."""
    agent = Agent(config(tmp_path), TlsFiles.for_service(certs_dir, "agent", "node-1"))
    with structlog.testing.capture_logs() as logs:
        runner = asyncio.create_task(agent.run())
        await started(agent)
        agent.parts.tasks["logs"].cancel()
        with pytest.raises(PartFailed) as failed:
            await asyncio.wait_for(runner, 10)
    assert str(failed.value) == (
        "agent: its logs failed (CancelledError: cancelled while the service ran); stopped"
    )
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [(e["event"], e["part"]) for e in errors] == [
        ("service part failed; stopping the service", "logs")
    ]
