"""Agent sessions: output paced by credit, cancel and disconnect end them quietly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from google.rpc import code_pb2

from orka.agent.logs import LogKeeper
from orka.agent.sessions import Sessions
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb


def setup(tmp_path: Path) -> tuple[Sessions, list[apb.AgentMessage], Path]:
    out = tmp_path / "stdout.log"
    err = tmp_path / "stderr.log"
    out.write_bytes(b"x" * (100 << 10))  # four chunks
    err.write_bytes(b"")
    driver = SimpleNamespace(log_paths=lambda name: (out, err), log_backup=None, keeps_logs=True)
    instances = {"web-1": SimpleNamespace(name="web-1", driver=driver)}
    sent: list[apb.AgentMessage] = []
    sessions = Sessions(instances, sent.append, LogKeeper(instances, 1 << 20))  # type: ignore[arg-type]
    return sessions, sent, out


def outputs(sent: list[apb.AgentMessage]) -> list[apb.SessionOutput]:
    return [m.session_output for m in sent]


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0.01)


async def test_outputs_wait_for_credit(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    req = pb.ReadLogsRequest(instance="web-1", stream=pb.LogChunk.STDOUT)
    sessions.on_open(apb.SessionOpen(session="s1", logs=req, credit=2))
    await settle()
    assert [o.WhichOneof("body") for o in outputs(sent)] == ["log", "log"]  # then it waits
    sessions.on_input(apb.SessionInput(session="s1", credit=10))
    await settle()
    kinds = [o.WhichOneof("body") for o in outputs(sent)]
    assert kinds == ["log"] * 4 + ["end"]
    assert sum(len(o.log.data) for o in outputs(sent)[:4]) == 100 << 10
    assert outputs(sent)[-1].end.code == code_pb2.OK and len(sessions) == 0


async def test_cancel_and_disconnect_end_sessions_without_a_word(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    follow = pb.ReadLogsRequest(instance="web-1", follow=True)
    sessions.on_open(apb.SessionOpen(session="s1", logs=follow, credit=100))
    sessions.on_open(apb.SessionOpen(session="s2", logs=follow, credit=100))
    await settle()
    assert len(sessions) == 2
    sessions.on_input(apb.SessionInput(session="s1", cancel=True))
    sessions.close_all()
    await settle()
    assert len(sessions) == 0
    assert not [o for o in outputs(sent) if o.WhichOneof("body") == "end"]


async def test_unknown_instance_ends_not_found(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    sessions.on_open(apb.SessionOpen(session="s1", logs=pb.ReadLogsRequest(instance="nope")))
    await settle()
    (end,) = outputs(sent)
    assert end.end.code == code_pb2.NOT_FOUND and "nope" in end.end.message


async def test_a_follow_ends_when_the_instance_goes(tmp_path: Path) -> None:
    sessions, sent, _ = setup(tmp_path)
    follow = pb.ReadLogsRequest(instance="web-1", follow=True, stream=pb.LogChunk.STDOUT)
    sessions.on_open(apb.SessionOpen(session="s1", logs=follow, credit=100))
    await settle()
    assert len(sessions) == 1
    del sessions.instances["web-1"]  # type: ignore[attr-defined]
    for _ in range(100):
        if not len(sessions):
            break
        await asyncio.sleep(0.05)
    assert not len(sessions)
    assert outputs(sent)[-1].end.code == code_pb2.OK


def test_the_log_keeper_looks_only_at_drivers_that_keep_log_files(tmp_path: Path) -> None:
    def inst(name: str, **driver: object) -> SimpleNamespace:
        paths = (tmp_path / name / "stdout.log", tmp_path / name / "stderr.log")
        fields = {"log_paths": lambda _: paths, "log_backup": None, "keeps_logs": True} | driver
        return SimpleNamespace(name=name, driver=SimpleNamespace(**fields))

    instances = {
        "web-1": inst("web-1"),
        "vm-1": inst("vm-1", log_backup="console.log.0"),  # virtlogd bounds its own
        "fake-1": inst("fake-1", keeps_logs=False),  # writes none
    }
    keeper = LogKeeper(instances, 1 << 20)  # type: ignore[arg-type]
    assert keeper.paths() == [tmp_path / "web-1" / "stderr.log", tmp_path / "web-1" / "stdout.log"]
    from orka.runtime.fake import FakeDriver

    assert FakeDriver.keeps_logs is False
