"""The agent's runner on the fake driver, a real state file and the real admission: what a
restarted agent re-adopts, starts again, keeps as ended or removes; a start recorded before it
runs (and refused when it cannot be); stops; the node's usage; stopping everything."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from google.rpc import code_pb2
from structlog.testing import capture_logs

from orka.agent.admission import Admission
from orka.agent.runner import Runner
from orka.agent.secret_files import SecretFiles
from orka.agent.state import AgentState, InstanceRecord, StateFile
from orka.api import agent_pb2 as apb
from orka.models import (
    InstancePhase,
    Resources,
    VolumeAttachment,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc import convert, convert_volumes
from orka.runtime.base import RunSpec
from orka.runtime.fake import STOPPED_EXIT_CODE, FakeDriver
from tests.waits import until

MI = 1 << 20


def spec(cpu: int = 100, kind: WorkloadKind = WorkloadKind.PROCESS, **env: str) -> WorkloadSpec:
    return WorkloadSpec(
        name="web",
        kind=kind,
        command=["serve"],
        image="/images/web.qcow2" if kind is WorkloadKind.VM else "",
        resources=Resources(cpu_millis=cpu, memory_bytes=16 * MI),
        env=env,
    )


class Volumes:
    """Records the volumes a re-adopted instance holds again."""

    def __init__(self) -> None:
        self.held: list[tuple[str, WorkloadKind, list[VolumeAttachment]]] = []

    def hold(self, name: str, kind: WorkloadKind, volumes: list[VolumeAttachment]) -> None:
        self.held.append((name, kind, list(volumes)))


class Node:
    def __init__(self, tmp_path: Path, fake: FakeDriver | None = None, **runner: Any) -> None:
        self.fake = fake or FakeDriver()
        self.instances: dict[str, Any] = {}
        self.acks: list[tuple[str, int, str]] = []
        self.changes: list[tuple[str, InstancePhase, str]] = []
        self.admission = Admission(
            capacity=Resources(cpu_millis=1000, memory_bytes=1024 * MI),
            allowed_paths=[tmp_path],
            healthy={"fake": self.fake},
            instances=self.instances,
            shutting_down=lambda: False,
            send=lambda msg: None,
        )
        self.state_file = StateFile(tmp_path / "state.json", delay=0.0)
        self.runner = Runner(
            node="n1",
            drivers={"fake": self.fake},
            healthy={"fake": self.fake},
            state_file=self.state_file,
            secret_files=SecretFiles([]),
            admission=self.admission,
            ack=lambda cid, st: self.acks.append((cid, st.code, st.message)),
            on_change=lambda inst: self.changes.append((inst.name, inst.phase, inst.message)),
            instances=self.instances,
            **runner,
        )

    def recorded(self) -> dict[str, Any]:
        path = self.state_file.path
        return json.loads(path.read_text())["instances"] if path.exists() else {}

    def start(self, name: str, s: WorkloadSpec, command_id: str = "c1") -> None:
        a = apb.Assignment(instance=name, generation=3, spec=convert.spec_to_pb(s))
        self.runner.on_start(apb.StartInstance(command_id=command_id, assignment=a))


def record(name: str, phase: InstancePhase, **fields: Any) -> InstanceRecord:
    return InstanceRecord(
        name=name, workload="web", generation=2, spec=spec(), phase=phase, **fields
    )


async def test_a_start_is_recorded_before_it_runs_then_acked(tmp_path: Path) -> None:
    node = Node(tmp_path)
    seen_at_start: list[dict[str, Any]] = []
    real_start = node.fake.start

    async def start(run: RunSpec) -> Any:
        seen_at_start.append(node.recorded())
        return await real_start(run)

    node.fake.start = start  # type: ignore[method-assign]
    node.start("web-1", spec())
    assert "web-1" in node.instances and not node.acks  # acked once recorded
    await until(lambda: node.acks)
    assert node.acks == [("c1", code_pb2.OK, "")]
    await until(lambda: node.instances["web-1"].phase is InstancePhase.RUNNING)
    (at_start,) = seen_at_start
    assert at_start["web-1"]["generation"] == 3
    assert ("web-1", InstancePhase.RUNNING, "") in node.changes
    # What the runner spawned is let go of once done.
    await until(lambda: not node.runner._background)
    await node.runner.stop_all("test")


async def test_a_start_that_cannot_be_recorded_is_refused_and_never_runs(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("a file where the folder should be")
    node = Node(tmp_path)
    node.runner.state_file = node.state_file = StateFile(blocker / "state.json", delay=0.0)
    node.start("web-1", spec())
    await until(lambda: node.acks)
    ((cid, code, message),) = node.acks
    assert (cid, code) == ("c1", code_pb2.UNAVAILABLE)
    assert message.startswith("cannot record the instance in the state file: ")
    assert str(blocker) in message
    assert node.instances == {} and await node.fake.list() == []
    assert node.admission.allocated() == Resources()


async def test_a_start_of_what_runs_here_is_acked_and_changes_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.start("web-1", spec(), "c1")
    await until(lambda: node.acks)
    first = node.instances["web-1"]
    node.start("web-1", spec(cpu=900), "c2")
    assert node.acks[-1] == ("c2", code_pb2.OK, "")
    assert node.instances["web-1"] is first and first.spec.resources.cpu_millis == 100
    await node.runner.stop_all("test")


async def test_an_assignment_that_does_not_parse_is_invalid(tmp_path: Path) -> None:
    node = Node(tmp_path)
    a = apb.Assignment(instance="web-1", generation=1, spec=convert.spec_to_pb(spec()))
    a.spec.kind = 0  # no kind
    node.runner.on_start(apb.StartInstance(command_id="c1", assignment=a))
    ((cid, code, message),) = node.acks
    assert (cid, code) == ("c1", code_pb2.INVALID_ARGUMENT)
    assert message.startswith("invalid assignment: ")
    assert node.instances == {} and not node.state_file.path.exists()


async def test_a_start_the_node_has_no_room_for_is_refused_with_why(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.start("web-1", spec(cpu=5000))
    ((cid, code, message),) = node.acks
    assert (cid, code) == ("c1", code_pb2.FAILED_PRECONDITION)
    assert "cpu" in message
    assert node.instances == {} and node.admission.reservations == {}


async def test_an_instance_stopped_before_its_record_is_written_never_starts(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path)
    node.start("web-1", spec())
    node.runner.on_stop(apb.StopInstance(command_id="s1", instance="web-1", remove=True))
    await until(lambda: len(node.acks) == 2)
    assert sorted(node.acks) == [("c1", code_pb2.OK, ""), ("s1", code_pb2.OK, "")]
    await until(lambda: "web-1" not in node.instances)
    assert await node.fake.list() == []


async def test_stop_keeps_or_removes_as_asked_and_gives_the_reason(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.start("web-1", spec(), "c1")
    node.start("web-2", spec(), "c2")
    await until(lambda: len(node.acks) == 2)
    await until(lambda: all(i.phase is InstancePhase.RUNNING for i in node.instances.values()))
    node.runner.on_stop(apb.StopInstance(command_id="s1", instance="web-1", reason="drained"))
    node.runner.on_stop(apb.StopInstance(command_id="s2", instance="web-2", remove=True))
    node.runner.on_stop(apb.StopInstance(command_id="s3", instance="nope", remove=True))
    await until(lambda: len(node.acks) == 5)
    assert [a[:2] for a in node.acks[2:]] == [(c, code_pb2.OK) for c in ("s1", "s2", "s3")]
    await until(lambda: "web-2" not in node.instances)
    assert [t.instance for t in await node.fake.list()] == ["web-1"]  # web-2's task removed
    kept = node.instances["web-1"]
    await until(lambda: kept.phase is InstancePhase.STOPPED)
    assert (kept.exit_code, kept.reason, kept.message) == (STOPPED_EXIT_CODE, "Stopped", "drained")
    await until(lambda: set(node.recorded()) == {"web-1"})
    assert node.admission.allocated() == Resources()  # a stopped instance holds nothing
    await node.runner.stop_all("test")


async def test_usage_sums_what_holds_room_and_skips_what_cannot_say(tmp_path: Path) -> None:
    node = Node(tmp_path)
    for i, cpu in enumerate((100, 200, 400)):
        node.start(f"web-{i}", spec(cpu=cpu), f"c{i}")
    await until(lambda: len(node.acks) == 3)
    await until(lambda: all(i.phase is InstancePhase.RUNNING for i in node.instances.values()))
    assert node.runner.holding
    assert await node.runner.usage() == Resources(cpu_millis=700, memory_bytes=48 * MI)
    # One whose driver has lost it is left out, not a failure of the whole sum.
    del node.fake._tasks["web-2"]
    assert await node.runner.usage() == Resources(cpu_millis=300, memory_bytes=32 * MI)
    await node.runner.stop_all("leaving")
    assert not node.runner.holding and node.instances == {}
    assert await node.fake.list() == []  # stopped and removed
    stopped = {n for n, phase, why in node.changes if phase is InstancePhase.STOPPED}
    assert stopped == {"web-0", "web-1", "web-2"}
    assert ("web-0", InstancePhase.STOPPED, "leaving") in node.changes
    assert node.recorded() == {}
    assert node.admission.allocated() == Resources()


async def test_a_restarted_agent_adopts_keeps_restarts_and_removes_orphans(
    tmp_path: Path,
) -> None:
    fake = FakeDriver()
    # Left running by the agent before: two recorded tasks, and one it never recorded.
    for name in ("web-run", "web-orphan"):
        await fake.start(RunSpec(instance=name, workload="web", spec=spec()))
    pid = next(t.pid for t in await fake.list() if t.instance == "web-run")
    volume = VolumeAttachment(name="data", size_bytes=1 << 30, backend="dir", mount_path="/d")
    # The records the loop passes over come first: those after them are adopted all the same.
    records = {
        # A kind no healthy driver here runs: left out.
        "vm-1": record("vm-1", InstancePhase.RUNNING).model_copy(
            update={"spec": spec(kind=WorkloadKind.VM)}
        ),
        # Recorded running, but its task is gone: started again.
        "web-gone": record("web-gone", InstancePhase.RUNNING, restarts=1),
        "web-done": record(
            "web-done",
            InstancePhase.FAILED,
            exit_code=3,
            reason="Error",
            message="exit code 3",
            finished_at=12.5,
        ),
        "web-run": record("web-run", InstancePhase.RUNNING, restarts=4, volumes=[volume]),
    }
    path = tmp_path / "state.json"
    path.write_text(AgentState(node="n1", instances=records).model_dump_json())
    volumes = Volumes()
    node = Node(tmp_path, fake, volumes=volumes)
    # The fake driver stands in for the process driver; libvirt is down.
    node.runner.drivers = {"process": fake, "libvirt": FakeDriver()}
    node.runner.healthy = {"process": fake}
    with capture_logs() as logs:
        await node.runner.adopt()
        await until(
            lambda: (
                node.instances["web-gone"].phase is InstancePhase.RUNNING
                and node.instances["web-run"].phase is InstancePhase.RUNNING
            )
        )
    assert set(node.instances) == {"web-run", "web-gone", "web-done"}
    run, gone, done = (node.instances[n] for n in ("web-run", "web-gone", "web-done"))
    assert run.restarts == 4 and gone.restarts == 1
    assert run.generation == gone.generation == done.generation == 2
    assert run.volumes == (volume,) and gone.volumes == ()
    tasks = {t.instance: t for t in await fake.list()}
    assert set(tasks) == {"web-run", "web-gone"}  # the orphan removed
    assert tasks["web-run"].pid == pid  # the same task, not a new one
    assert (done.phase, done.exit_code, done.reason, done.message, done.finished_at) == (
        InstancePhase.FAILED,
        3,
        "Error",
        "exit code 3",
        12.5,
    )
    assert volumes.held == [("web-run", WorkloadKind.PROCESS, [volume])]
    events = [(e["event"], e.get("instance")) for e in logs if e["log_level"] == "info"]
    assert ("re-adopted instance", "web-run") in events
    assert ("removing orphan task", "web-orphan") in events
    assert ("re-adopted instance", "web-gone") not in events
    readopted = next(e for e in logs if e["event"] == "re-adopted instance")
    assert readopted["pid"] == pid
    orphan = next(e for e in logs if e["event"] == "removing orphan task")
    assert orphan["driver"] == "fake"
    # What runs and what ended hold what they should, and the file says what is here now.
    assert node.admission.allocated() == Resources(cpu_millis=200, memory_bytes=32 * MI)
    await until(lambda: set(node.recorded()) == {"web-run", "web-gone", "web-done"})
    await node.runner.stop_all("test")


async def test_adopt_goes_on_past_a_driver_that_cannot_list(tmp_path: Path) -> None:
    node = Node(tmp_path)
    broken = FakeDriver()

    async def cannot() -> list[Any]:
        raise RuntimeError("socket gone")

    broken.list = cannot  # type: ignore[method-assign]
    node.runner.drivers = {"libvirt": broken, "fake": node.fake}
    await node.fake.start(RunSpec(instance="orphan", workload="web", spec=spec()))
    (tmp_path / "state.json").write_text(
        AgentState(node="n1", instances={"w": record("w", InstancePhase.RUNNING)}).model_dump_json()
    )
    await node.runner.adopt()
    await until(lambda: node.instances["w"].phase is InstancePhase.RUNNING)
    assert [t.instance for t in await node.fake.list()] == ["w"]
    await node.runner.stop_all("test")


@pytest.mark.parametrize("phase", [InstancePhase.SUCCEEDED, InstancePhase.STOPPED])
async def test_an_ended_record_is_kept_as_it_ended_and_not_started(
    tmp_path: Path, phase: InstancePhase
) -> None:
    node = Node(tmp_path)
    (tmp_path / "state.json").write_text(
        AgentState(
            node="n1", instances={"w": record("w", phase, exit_code=0, finished_at=5.0)}
        ).model_dump_json()
    )
    await node.runner.adopt()
    await asyncio.sleep(0.05)
    assert node.instances["w"].phase is phase and await node.fake.list() == []
    assert node.admission.allocated() == Resources()


async def test_an_instance_gets_the_nodes_address_secrets_volumes_and_its_attachments(
    tmp_path: Path,
) -> None:
    volumes = Volumes()
    node = Node(tmp_path, host_ip="10.1.2.3", volumes=volumes)
    volume = VolumeAttachment(name="data", size_bytes=1 << 30, backend="dir", mount_path="/d")
    a = apb.Assignment(instance="web-1", generation=1, spec=convert.spec_to_pb(spec()))
    a.volumes.append(convert_volumes.attachment_to_pb(volume))
    node.runner.on_start(apb.StartInstance(command_id="c1", assignment=a))
    inst = node.instances["web-1"]
    assert inst.host_ip == "10.1.2.3"
    assert inst.secret_files is node.runner.secret_files
    assert inst.volume_manager is volumes
    assert inst.volumes == (volume,)
    inst.stopping = True  # its volumes are not mounted here: it must not start
    await until(lambda: node.acks)
    await node.runner.stop_all("test")


def test_a_runner_given_no_table_keeps_its_own(tmp_path: Path) -> None:
    runner = Runner(
        node="n1",
        drivers={},
        healthy={},
        state_file=StateFile(tmp_path / "state.json"),
        secret_files=SecretFiles([]),
        admission=Node(tmp_path).admission,
        ack=lambda cid, st: None,
        on_change=lambda inst: None,
    )
    assert runner.instances == {} and runner.state() == '{"node":"n1","instances":{}}'
    assert runner.host_ip == ""  # no address reported unless the agent is given one


async def test_an_instance_stopped_while_its_record_is_written_is_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Node(tmp_path)
    gate = asyncio.Event()
    persist = node.state_file.persist

    async def slow_persist() -> None:
        await gate.wait()
        await persist()

    monkeypatch.setattr(node.state_file, "persist", slow_persist)
    node.start("web-1", spec())
    inst = node.instances["web-1"]
    # Stopped (kept, not removed) before the record is on disk.
    node.runner.on_stop(apb.StopInstance(command_id="s1", instance="web-1"))
    await until(lambda: inst.phase is InstancePhase.STOPPED)
    gate.set()
    await until(lambda: len(node.acks) == 2)
    await asyncio.sleep(0.05)
    assert await node.fake.list() == [] and inst.phase is InstancePhase.STOPPED


async def test_a_start_is_weighed_without_the_hold_of_its_own_offer(tmp_path: Path) -> None:
    node = Node(tmp_path)
    big = spec(cpu=600)
    a = apb.Assignment(instance="web-1", generation=1, spec=convert.spec_to_pb(big))
    node.admission.on_offer(apb.Offer(offer_id="o1", assignment=a, hold_seconds=30))
    assert node.admission.allocated().cpu_millis == 600
    # 600 held for it and 600 asked of 1,000: the hold is its own, so it fits.
    node.runner.on_start(apb.StartInstance(command_id="c1", assignment=a))
    await until(lambda: node.acks)
    assert node.acks == [("c1", code_pb2.OK, "")]
    assert node.admission.allocated().cpu_millis == 600
    await node.runner.stop_all("test")


async def test_an_orphan_that_will_not_go_does_not_stop_the_adoption(tmp_path: Path) -> None:
    node = Node(tmp_path)
    await node.fake.start(RunSpec(instance="orphan", workload="web", spec=spec()))

    async def refuse(instance: str, keep_network: bool = False) -> None:
        raise RuntimeError("device busy")

    node.fake.remove = refuse  # type: ignore[method-assign]
    (tmp_path / "state.json").write_text(
        AgentState(node="n1", instances={"w": record("w", InstancePhase.RUNNING)}).model_dump_json()
    )
    await node.runner.adopt()
    await until(lambda: node.instances["w"].phase is InstancePhase.RUNNING)
    await until(lambda: set(node.recorded()) == {"w"})
    assert set(node.instances) == {"w"}
