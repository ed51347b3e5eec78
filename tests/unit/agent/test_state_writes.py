"""The state file's writes and reads in detail: what is written, which records are encoded
again, how saves are coalesced, what a failed write or a bad file is reported as."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from orka.agent import state as state_mod
from orka.agent.state import AgentState, InstanceRecord, StateEncoder, StateFile, encode_state
from orka.models import InstancePhase, VolumeAttachment, WorkloadKind, WorkloadSpec

SPEC = WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["sleep", "9"])


def record(name: str, **changes: object) -> InstanceRecord:
    fields: dict[str, object] = {
        "name": name,
        "workload": "web",
        "generation": 2,
        "spec": SPEC,
        "phase": InstancePhase.RUNNING,
        "restarts": 1,
        "started_at": 10.0,
    }
    return InstanceRecord.model_validate(fields | changes)


def test_the_text_is_the_models_volumes_included() -> None:
    volumes = [
        VolumeAttachment(name="data", size_bytes=1 << 30, backend="dir", mount_path="/data"),
        VolumeAttachment(
            name="logs", size_bytes=1 << 20, backend="ext4", mount_path="/logs", read_only=True
        ),
    ]
    records = [record("web-1", volumes=volumes), record("web-2")]
    model = AgentState(node="n1", instances={r.name: r for r in records})
    want = json.loads(model.model_dump_json())
    assert json.loads(encode_state("n1", records)) == want
    assert json.loads(StateEncoder("n1").encode(records)) == want
    assert len(want["instances"]["web-1"]["volumes"]) == 2


def test_an_instance_without_volumes_is_written_with_none() -> None:
    # The agent's own instance type has no `volumes` attribute until it is given some.
    full = record("web-1")
    inst = SimpleNamespace(
        **{f: getattr(full, f) for f in type(full).model_fields if f != "volumes"}
    )
    text = encode_state("n1", [inst])  # type: ignore[list-item]
    assert json.loads(text)["instances"]["web-1"]["volumes"] == []
    assert AgentState.model_validate_json(text) == AgentState(node="n1", instances={"web-1": full})


def test_the_encoder_encodes_again_only_the_records_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoded: list[str] = []
    real = state_mod._entry

    def entry(inst: state_mod.RecordSource, values: tuple[object, ...]) -> str:
        encoded.append(inst.name)
        return real(inst, values)

    monkeypatch.setattr(state_mod, "_entry", entry)
    records = [record("web-1"), record("web-2"), record("web-3")]
    encoder = StateEncoder("n1")
    encoder.encode(records)
    assert encoded == ["web-1", "web-2", "web-3"]
    encoded.clear()
    records[1].restarts = 2
    text = encoder.encode(records)
    assert encoded == ["web-2"]
    assert text == encode_state("n1", records)
    encoded.clear()
    # The same status in a new object under a known name: encoded anew.
    records[2] = record("web-3")
    encoder.encode(records)
    assert encoded == ["web-3"]


async def test_saves_within_the_delay_are_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[bytes] = []
    real = StateFile._write

    def write(self: StateFile, data: bytes) -> None:
        writes.append(data)
        real(self, data)

    monkeypatch.setattr(StateFile, "_write", write)
    sf = StateFile(tmp_path / "state.json", delay=30.0)
    for names in (("a",), ("a", "b"), ("a", "b", "c")):
        sf.save(AgentState(node="n1", instances={n: record(n) for n in names}))
        await asyncio.sleep(0.05)  # the writer has woken: it waits out the delay
    await sf.persist()
    assert len(writes) == 1
    assert set(json.loads(writes[0])["instances"]) == {"a", "b", "c"}
    # A persist with everything written leaves the next saves to the delay as well.
    await sf.persist()
    sf.save(AgentState(node="n1"))
    await asyncio.sleep(0.05)
    sf.save(AgentState(node="n1", instances={"d": record("d")}))
    await asyncio.sleep(0.05)
    assert len(writes) == 1
    await sf.persist()
    assert len(writes) == 2 and set(json.loads(writes[1])["instances"]) == {"d"}
    await sf.flush()


async def test_the_writer_task_is_named(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "state.json")
    assert sf.writer().get_name() == "state-writer"
    await sf.flush()


async def test_a_longer_temp_file_left_by_a_crash_is_overwritten_whole(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.with_suffix(".tmp").write_text("x" * 100_000)
    sf = StateFile(path)
    sf.save(AgentState(node="n1", instances={"a": record("a")}))
    await sf.flush()
    assert path.read_text() == AgentState(node="n1", instances={"a": record("a")}).model_dump_json()
    assert not path.with_suffix(".tmp").exists()  # renamed into place, not left beside it


async def test_missing_folders_on_the_way_are_made(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "a" / "b" / "state.json")
    sf.save(AgentState(node="n1"))
    await sf.persist()
    assert StateFile(sf.path).load("n1") == AgentState(node="n1")
    await sf.flush()


async def test_a_failed_write_is_logged_with_the_path_and_the_error(tmp_path: Path) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("a file where the folder should be")
    sf = StateFile(blocker / "state.json", delay=30.0)
    sf.save(AgentState(node="n1"))
    with capture_logs() as logs, pytest.raises(OSError) as raised:
        await sf.persist()
    (logged,) = logs
    assert logged == {
        "event": "could not write the state file",
        "log_level": "error",
        "path": str(blocker / "state.json"),
        "error": str(raised.value),
    }
    assert str(blocker) in logged["error"]
    await sf.flush()


def loads_empty_with_a_warning(path: Path, event: str, **fields: object) -> None:
    """Node n1 loads `path` as an empty state, and one warning says why, naming the file."""
    with capture_logs() as logs:
        assert StateFile(path).load("n1") == AgentState(node="n1")
    assert logs == [{"event": event, "log_level": "warning", "path": str(path), **fields}]


def test_a_file_of_another_node_is_logged_with_its_node(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(AgentState(node="n2").model_dump_json())
    loads_empty_with_a_warning(path, "state file belongs to another node", node="n2")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\xff\xfe not text", "UnicodeDecodeError"),
        (b'{"node": "n1",\n "instances": [}', "not JSON: Expecting value at line 2 column 16"),
    ],
)
def test_an_unreadable_file_is_logged_with_why(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    loads_empty_with_a_warning(path, "ignoring unreadable state file", error=reason)


def test_an_invalid_file_names_at_most_five_fields(tmp_path: Path) -> None:
    bad = {"node": "n1", "instances": {f"w{i}": {"name": f"w{i}"} for i in range(3)}}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(bad))
    with capture_logs() as logs:
        StateFile(path).load("n1")
    # Each record lacks workload, generation, spec and phase: 12 errors, 5 named.
    assert logs[0]["error"] == (
        "12 invalid field(s): instances.w0.workload, instances.w0.generation, "
        "instances.w0.spec, instances.w0.phase, instances.w1.workload"
    )
