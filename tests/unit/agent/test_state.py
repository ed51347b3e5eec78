"""The agent's local state file: atomic writes, and a bad file never stops the agent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orka.agent.state import AgentState, InstanceRecord, StateEncoder, StateFile, encode_state
from orka.models import InstancePhase, WorkloadKind, WorkloadSpec


def record(name: str = "web-1", phase: InstancePhase = InstancePhase.RUNNING) -> InstanceRecord:
    return InstanceRecord(
        name=name,
        workload="web",
        generation=2,
        spec=WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["sleep", "9"]),
        phase=phase,
        restarts=1,
        started_at=10.0,
    )


def state(node: str = "n1", *names: str) -> AgentState:
    return AgentState(node=node, instances={n: record(n) for n in names})


async def test_save_flush_load_round_trip(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "sub" / "state.json")
    s = state("n1", "web-1", "web-2")
    sf.save(s)
    await sf.flush()
    assert sf.path.exists()
    assert not sf.path.with_suffix(".tmp").exists()
    assert StateFile(sf.path).load("n1") == s


async def test_last_save_wins(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "state.json")
    for names in (("a",), ("a", "b"), ("c",)):
        sf.save(state("n1", *names))
    await sf.flush()
    assert set(sf.load("n1").instances) == {"c"}


async def test_flush_without_save_writes_nothing(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "state.json")
    await sf.flush()
    assert not sf.path.exists()
    assert sf.load("n1") == AgentState(node="n1")


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{not json",
        "[]",
        '{"instances": {}}',
        json.dumps({"node": "n1", "instances": {"x": {"name": "x"}}}),
        json.dumps(
            {
                "node": "n1",
                "instances": {"x": {**record().model_dump(mode="json"), "phase": "DANCING"}},
            }
        ),
    ],
)
def test_corrupt_file_gives_empty_state(tmp_path: Path, content: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(content)
    assert StateFile(path).load("n1") == AgentState(node="n1")


def test_binary_garbage_gives_empty_state(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert StateFile(path).load("n1") == AgentState(node="n1")


def test_missing_file_gives_empty_state(tmp_path: Path) -> None:
    assert StateFile(tmp_path / "nope.json").load("n7") == AgentState(node="n7")


async def test_file_of_another_node_is_ignored(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "state.json")
    sf.save(state("other", "web-1"))
    await sf.flush()
    loaded = sf.load("n1")
    assert loaded.node == "n1"
    assert loaded.instances == {}
    # The file itself is left alone; its owner can still read it.
    assert set(sf.load("other").instances) == {"web-1"}


async def test_persist_writes_now_despite_the_delay(tmp_path: Path) -> None:
    # A delay far longer than the test: only persist() can have written the file.
    f = StateFile(tmp_path / "s.json", delay=3600)
    f.save(state("n1", "web-1"))
    await f.persist()
    assert set(StateFile(tmp_path / "s.json").load("n1").instances) == {"web-1"}
    f.save(lambda: state("n1", "web-1", "web-2"))
    await f.persist()
    assert set(StateFile(tmp_path / "s.json").load("n1").instances) == {"web-1", "web-2"}
    await f.flush()


async def test_persist_with_nothing_saved_returns(tmp_path: Path) -> None:
    f = StateFile(tmp_path / "s.json", delay=3600)
    await f.persist()
    assert not (tmp_path / "s.json").exists()


async def test_saves_are_coalesced_after_the_delay(tmp_path: Path) -> None:
    f = StateFile(tmp_path / "s.json", delay=0.05)
    for i in range(20):
        f.save(state("n1", *(f"web-{j}" for j in range(i + 1))))
    assert not (tmp_path / "s.json").exists()  # nothing written synchronously
    await f.persist()
    assert len(StateFile(tmp_path / "s.json").load("n1").instances) == 20
    await f.flush()


async def test_a_failed_write_is_raised_to_persist_and_the_next_one_recovers(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("a file where the directory should be")
    sf = StateFile(blocker / "state.json", delay=10.0)
    sf.save(state("n1", "web-1"))
    with pytest.raises(OSError):
        await sf.persist()
    # The writer is still there: once the disk is fixed, the next change is written.
    blocker.unlink()
    sf.save(state("n1", "web-1", "web-2"))
    await sf.persist()
    assert set(StateFile(sf.path).load("n1").instances) == {"web-1", "web-2"}
    await sf.flush()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


async def test_the_state_file_and_its_folder_are_owner_only(tmp_path: Path) -> None:
    """The file holds the specs the agent runs, secret values included."""
    sf = StateFile(tmp_path / "agent" / "agent-state.json")
    sf.save(state("n1", "web-1"))
    await sf.flush()
    assert _mode(sf.path) == 0o600
    assert _mode(sf.path.parent) == 0o700


async def test_an_open_state_file_is_tightened_at_load_and_replaced_owner_only(
    tmp_path: Path,
) -> None:
    path = tmp_path / "agent-state.json"
    path.write_text(state("n1", "web-1").model_dump_json())
    path.chmod(0o644)
    path.with_suffix(".tmp").write_text("left by a crash")
    path.with_suffix(".tmp").chmod(0o644)
    sf = StateFile(path)
    assert sf.load("n1") == state("n1", "web-1")
    assert _mode(path) == 0o600
    sf.save(state("n1", "web-2"))
    await sf.flush()
    assert _mode(path) == 0o600
    assert StateFile(path).load("n1") == state("n1", "web-2")


def test_an_invalid_state_file_is_reported_without_its_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from structlog.testing import capture_logs

    path = tmp_path / "agent-state.json"
    bad = json.loads(state("n1", "web-1").model_dump_json())
    # A whole-spec error (a process without a command): pydantic's own message would quote
    # the spec, secret first.
    spec = bad["instances"]["web-1"]["spec"]
    spec["command"] = []
    bad["instances"]["web-1"]["spec"] = {"secret_env": {"TOKEN": "hunter2-secret"}, **spec}
    path.write_text(json.dumps(bad))
    with capture_logs() as logs:
        assert StateFile(path).load("n1") == AgentState(node="n1")
    assert logs[0]["event"] == "ignoring unreadable state file"
    assert logs[0]["error"] == "1 invalid field(s): instances.web-1.spec"
    assert "hunter2-secret" not in repr(logs)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"phase": InstancePhase.FAILED, "exit_code": 3, "finished_at": 12.5, "reason": "Error"},
        {"message": 'quotes " and \\ and \u00e9', "started_at": None},
    ],
)
def test_encode_state_writes_the_models_layout(changes: dict[str, object]) -> None:
    """The agent's fast writer and the model write the same JSON: every field of the record,
    none more (a field added to InstanceRecord is written without touching the writer)."""
    records = [record("web-1").model_copy(update=changes), record("web-2")]
    fast = json.loads(encode_state("n1", records))
    model = AgentState(node="n1", instances={r.name: r for r in records})
    assert fast == json.loads(model.model_dump_json())
    assert AgentState.model_validate(fast) == model


def test_state_encoder_writes_what_encode_state_writes_as_instances_change() -> None:
    """The agent's encoder keeps each record's text between writes: after changes made in
    place (as the supervisor makes them), an instance gone and one new, every write is
    exactly what encoding the whole state afresh gives."""
    records = [record("web-1"), record("web-2"), record("web-3")]
    encoder = StateEncoder("n1")
    assert encoder.encode(records) == encode_state("n1", records)
    records[1].phase = InstancePhase.FAILED
    records[1].exit_code = 3
    records[2].restarts = 1
    assert encoder.encode(records) == encode_state("n1", records)
    # A field back to an earlier value is still a change against the last write.
    records[1].phase = InstancePhase.RUNNING
    records[1].exit_code = None
    records = [records[0], records[1], record("web-4")]
    text = encoder.encode(records)
    assert text == encode_state("n1", records)
    assert set(json.loads(text)["instances"]) == {"web-1", "web-2", "web-4"}
    # A new instance object under a known name with the same status (stopped, then started
    # again with a new spec) is encoded anew: its spec is not the old one's.
    new_spec = WorkloadSpec(name="web", kind=WorkloadKind.PROCESS, command=["sleep", "7"])
    records[0] = record("web-1").model_copy(update={"spec": new_spec})
    text = encoder.encode(records)
    assert text == encode_state("n1", records)
    assert json.loads(text)["instances"]["web-1"]["spec"]["command"] == ["sleep", "7"]
