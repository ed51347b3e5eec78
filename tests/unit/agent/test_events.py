"""What the agent writes: its outgoing messages (unsent states are replaced by newer ones,
terminal states never are, what is queued together leaves in one batch) and its state file's
content."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2

from orka.agent.service import Agent, AgentConfig
from orka.agent.state import AgentState, InstanceRecord
from orka.agent.supervisor import Supervised
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.models import InstancePhase, WorkloadKind, WorkloadSpec
from orka.rpc import convert
from orka.runtime.fake import FakeDriver
from orka.security.tls import TlsFiles


class RecordingCall:
    """Stands in for the gRPC stream: keeps what the writer wrote."""

    def __init__(self) -> None:
        self.written: list[apb.AgentMessage] = []

    async def write(self, msg: apb.AgentMessage) -> None:
        self.written.append(msg)


def make_agent(tmp_path: Path) -> tuple[Agent, Supervised, asyncio.Queue[apb.AgentMessage | None]]:
    agent = Agent(
        AgentConfig(name="n1", schedulers=["127.0.0.1:1"], data_dir=tmp_path, runtimes=["fake"]),
        TlsFiles(tmp_path / "ca.crt", tmp_path / "n1.crt", tmp_path / "n1.key"),  # never dialled
    )
    outbox: asyncio.Queue[apb.AgentMessage | None] = asyncio.Queue()
    agent.stream.outbox = outbox
    spec = WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["x"])
    inst = agent.runner.new_instance("web-1", 1, spec, FakeDriver(tmp_path / "fake"))
    return agent, inst, outbox


def queued(outbox: asyncio.Queue[apb.AgentMessage | None]) -> list[apb.AgentMessage]:
    out = []
    while not outbox.empty():
        msg = outbox.get_nowait()
        assert msg is not None
        out.append(msg)
    return out


def send_start(agent: Agent, instance: str, command_id: str) -> None:
    spec = pb.WorkloadSpec(name="db", kind=pb.WorkloadSpec.PROCESS, command=["x"])
    assignment = apb.Assignment(instance=instance, generation=1, spec=spec)
    agent._on_message(
        apb.SchedulerMessage(start=apb.StartInstance(command_id=command_id, assignment=assignment))
    )


def change(agent: Agent, inst: Supervised, phase: InstancePhase, reason: str = "") -> None:
    inst.phase, inst.reason = phase, reason
    agent.runner.changed(inst)


async def loop_turns(count: int) -> None:
    """Let the event loop run `count` times (the writer takes what was queued)."""
    for _ in range(count):
        await asyncio.sleep(0)


async def test_an_unsent_state_is_replaced_by_the_newest(tmp_path: Path) -> None:
    agent, inst, outbox = make_agent(tmp_path)
    change(agent, inst, InstancePhase.STARTING)
    change(agent, inst, InstancePhase.RUNNING)
    msgs = queued(outbox)
    assert [m.instance_status.phase for m in msgs] == [pb.Instance.RUNNING]
    assert msgs[0].instance_status.name == "web-1"


async def test_terminal_states_are_never_replaced(tmp_path: Path) -> None:
    agent, inst, outbox = make_agent(tmp_path)
    change(agent, inst, InstancePhase.FAILED, "Error")
    change(agent, inst, InstancePhase.STARTING)
    msgs = queued(outbox)
    assert [(m.instance_status.phase, m.instance_status.reason) for m in msgs] == [
        (pb.Instance.FAILED, "Error"),
        (pb.Instance.STARTING, ""),
    ]


async def test_queued_messages_leave_in_one_batch_and_later_changes_are_new(
    tmp_path: Path,
) -> None:
    agent, inst, outbox = make_agent(tmp_path)
    agent.stream.ack("c1", convert.ok_status())
    change(agent, inst, InstancePhase.STARTING)
    change(agent, inst, InstancePhase.RUNNING)
    call = RecordingCall()
    writer = asyncio.create_task(agent.stream.writer(call, outbox))  # type: ignore[arg-type]
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(call.written) == 1
    batch = call.written[0].batch.messages
    assert [m.WhichOneof("body") for m in batch] == ["ack", "instance_status"]
    assert batch[1].instance_status.phase == pb.Instance.RUNNING

    # The event left: a later change goes out as a message of its own, alone.
    change(agent, inst, InstancePhase.FAILED, "Error")
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(call.written) == 2
    assert call.written[1].instance_status.phase == pb.Instance.FAILED
    outbox.put_nowait(None)
    await writer


def failed_then_restarting(
    tmp_path: Path,
) -> tuple[Agent, Supervised, asyncio.Queue[apb.AgentMessage | None]]:
    """An instance that failed and is starting again: two messages queued (a terminal state
    is never replaced, so the restart's state is a message of its own)."""
    agent, inst, outbox = make_agent(tmp_path)
    change(agent, inst, InstancePhase.FAILED, "Error")
    change(agent, inst, InstancePhase.STARTING)
    return agent, inst, outbox


async def test_a_terminal_state_and_the_next_leave_together_and_nothing_stays_unsent(
    tmp_path: Path,
) -> None:
    agent, _, outbox = failed_then_restarting(tmp_path)
    call = RecordingCall()
    writer = asyncio.create_task(agent.stream.writer(call, outbox))  # type: ignore[arg-type]
    await loop_turns(3)
    assert not writer.done()
    phases = [m.instance_status.phase for m in call.written[0].batch.messages]
    assert phases == [pb.Instance.FAILED, pb.Instance.STARTING]
    assert agent.stream._unsent_events == {}
    outbox.put_nowait(None)
    await writer


async def test_an_older_terminal_state_leaving_keeps_the_newer_one_replaceable(
    tmp_path: Path,
) -> None:
    agent, inst, outbox = failed_then_restarting(tmp_path)
    call = RecordingCall()
    # The writer takes the terminal state alone, then its queue ends; the restart's state
    # is still queued.
    front: asyncio.Queue[apb.AgentMessage | None] = asyncio.Queue()
    front.put_nowait(outbox.get_nowait())
    front.put_nowait(None)
    await asyncio.wait_for(agent.stream.writer(call, front), 10)  # type: ignore[arg-type]
    assert [m.instance_status.phase for m in call.written] == [pb.Instance.FAILED]
    # The queued STARTING is replaced by RUNNING, not followed by a message of its own.
    change(agent, inst, InstancePhase.RUNNING)
    assert [m.instance_status.phase for m in queued(outbox)] == [pb.Instance.RUNNING]


async def test_a_frame_that_holds_a_heartbeat_gets_no_second(tmp_path: Path) -> None:
    agent, _, outbox = make_agent(tmp_path)
    loop = asyncio.get_running_loop()
    agent.stream._next_beat = loop.time() + 0.1 * agent.stream.interval  # due soon
    agent.stream.ack("c1", convert.ok_status())
    agent.stream.send(agent.stream.heartbeat_message())
    call = RecordingCall()
    writer = asyncio.create_task(agent.stream.writer(call, outbox))  # type: ignore[arg-type]
    await loop_turns(3)
    assert [m.WhichOneof("body") for m in call.written[0].batch.messages] == ["ack", "heartbeat"]
    outbox.put_nowait(None)
    await writer


async def test_a_batch_from_the_scheduler_is_handled_in_order(tmp_path: Path) -> None:
    agent, _, outbox = make_agent(tmp_path)
    agent._on_message(
        apb.SchedulerMessage(
            batch=apb.SchedulerBatch(
                messages=[
                    apb.SchedulerMessage(release=apb.ReleaseOffer(command_id="r1", instance="a")),
                    apb.SchedulerMessage(release=apb.ReleaseOffer(command_id="r2", instance="b")),
                ]
            )
        )
    )
    assert [m.ack.command_id for m in queued(outbox)] == ["r1", "r2"]


async def test_state_file_content_reads_back_as_the_agent_state(tmp_path: Path) -> None:
    agent, inst, _ = make_agent(tmp_path)
    inst.phase, inst.restarts, inst.exit_code, inst.started_at = InstancePhase.FAILED, 2, 3, 5.0
    data = json.loads(agent.runner.state())
    state = AgentState.model_validate(data)
    assert state.node == "n1"
    assert state.instances == {
        "web-1": InstanceRecord(
            name="web-1",
            workload="web",
            generation=1,
            spec=inst.spec,
            phase=InstancePhase.FAILED,
            restarts=2,
            exit_code=3,
            started_at=5.0,
        )
    }


async def test_a_heartbeat_due_soon_rides_in_a_frame_being_sent(tmp_path: Path) -> None:
    agent, _, outbox = make_agent(tmp_path)
    loop = asyncio.get_running_loop()
    call = RecordingCall()
    writer = asyncio.create_task(agent.stream.writer(call, outbox))  # type: ignore[arg-type]

    # Not due for most of an interval: the frame goes alone.
    agent.stream._next_beat = loop.time() + 0.9 * agent.stream.interval
    agent.stream.ack("c1", convert.ok_status())
    for _ in range(3):
        await asyncio.sleep(0)
    assert [m.WhichOneof("body") for m in call.written] == ["ack"]

    # Due within half an interval: it joins the frame, and the schedule restarts from it.
    agent.stream._next_beat = loop.time() + 0.3 * agent.stream.interval
    agent.stream.ack("c2", convert.ok_status())
    for _ in range(3):
        await asyncio.sleep(0)
    assert [m.WhichOneof("body") for m in call.written[1].batch.messages] == ["ack", "heartbeat"]
    assert agent.stream._next_beat >= loop.time() + 0.9 * agent.stream.interval
    outbox.put_nowait(None)
    await writer


async def test_the_first_heartbeat_leaves_an_interval_after_registering(tmp_path: Path) -> None:
    """Not at once: the registration said all it would but the usage, and after a failover a
    beat behind every registration doubles what the new scheduler reads."""
    agent, _, outbox = make_agent(tmp_path)
    stream = agent.stream
    stream.interval = 0.3
    loop = asyncio.get_running_loop()
    began = loop.time()
    beats = asyncio.create_task(stream._heartbeats())
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        assert queued(outbox) == []
        first = await asyncio.wait_for(outbox.get(), 10)
        assert first is not None and first.WhichOneof("body") == "heartbeat"
        assert loop.time() - began >= 0.3
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)


def test_the_registration_says_the_interval_the_agent_beats_at(tmp_path: Path) -> None:
    agent, _, _ = make_agent(tmp_path)
    assert agent.stream.register_message().register.heartbeat_interval.ToMilliseconds() == 1000
    agent.stream.repace(apb.Pace(heartbeat_interval=Duration(seconds=4, nanos=500_000_000)))
    assert agent.stream.register_message().register.heartbeat_interval.ToMilliseconds() == 4500


async def test_a_start_is_acked_once_recorded_together_with_its_first_state(
    tmp_path: Path,
) -> None:
    agent, _, outbox = make_agent(tmp_path)
    agent.healthy["fake"] = FakeDriver(tmp_path / "fake")
    call = RecordingCall()
    writer = asyncio.create_task(agent.stream.writer(call, outbox))  # type: ignore[arg-type]
    send_start(agent, "db-1", "s1")
    # Nothing is acknowledged before the state file holds the instance.
    assert call.written == [] and outbox.empty()
    await agent.state_file.persist()
    for _ in range(10):
        if call.written:
            break
        await asyncio.sleep(0.01)
    on_disk = AgentState.model_validate_json(agent.state_file.path.read_text())
    assert "db-1" in on_disk.instances
    # One frame: the ack and the instance's first state (the fake driver runs it at once).
    assert len(call.written) == 1
    batch = call.written[0].batch.messages
    assert [m.WhichOneof("body") for m in batch] == ["ack", "instance_status"]
    assert (batch[0].ack.command_id, batch[0].ack.status.code) == ("s1", code_pb2.OK)
    assert (batch[1].instance_status.name, batch[1].instance_status.phase) == (
        "db-1",
        pb.Instance.RUNNING,
    )
    outbox.put_nowait(None)
    await writer
    await agent.instances["db-1"].close()


async def test_a_start_the_state_file_cannot_record_is_refused(tmp_path: Path) -> None:
    agent, _, outbox = make_agent(tmp_path)
    agent.healthy["fake"] = FakeDriver(tmp_path / "fake")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the directory should be")
    agent.state_file.path = blocker / "agent-state.json"
    call = RecordingCall()
    writer = asyncio.create_task(agent.stream.writer(call, outbox))  # type: ignore[arg-type]
    send_start(agent, "db-1", "s1")
    for _ in range(100):
        if call.written:
            break
        await asyncio.sleep(0.01)
    assert [m.WhichOneof("body") for m in call.written] == ["ack"]
    ack = call.written[0].ack
    assert (ack.command_id, ack.status.code) == ("s1", code_pb2.UNAVAILABLE)
    assert "cannot record the instance in the state file" in ack.status.message
    assert "db-1" not in agent.instances  # never started, not kept
    outbox.put_nowait(None)
    await writer
