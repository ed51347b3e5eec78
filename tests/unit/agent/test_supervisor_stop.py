"""Stopping a supervised instance (orka/agent/supervisor.py, `stop`): the phases it reports,
the exit code it keeps, what it removes, and that a failing driver never leaves it half-way."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog.testing

from orka.errors import RuntimeFailure
from orka.models import InstancePhase, RestartPolicy
from orka.runtime.base import TaskInfo, TaskState
from tests.unit.agent.test_supervisor import Played, Run, play


class Stops:
    """Wraps a played driver's stop and remove: counts them, and fails them when asked."""

    def __init__(self, p: Played, code: int | None = 143, fail: str = "", fail_remove: str = ""):
        self.calls: list[tuple[str, float]] = []
        self.code, self.fail, self.fail_remove = code, fail, fail_remove
        self.removed = p.driver.removed
        p.driver.stop = self.stop  # type: ignore[method-assign]
        p.driver.remove = self.remove  # type: ignore[method-assign]

    async def stop(self, instance: str, grace: float) -> TaskInfo:
        self.calls.append((instance, grace))
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeFailure(self.fail)
        return TaskInfo(
            instance=instance,
            workload="w",
            driver="scripted",
            state=TaskState.EXITED,
            exit_code=self.code,
            started_at=0.0,
        )

    async def remove(self, instance: str, keep_network: bool = False) -> None:
        if self.fail_remove:
            raise RuntimeFailure(self.fail_remove)
        self.removed.append(instance)


async def running() -> Played:
    # One run that goes on for ever: the instance is RUNNING when play returns.
    p = await play(RestartPolicy.ALWAYS, [])
    assert p.sup.phase is InstancePhase.RUNNING
    p.sup.start()  # watch it again: play closed the watch
    await asyncio.sleep(0)
    return p


async def test_stop_reports_stopping_then_stopped_with_the_exit_code_and_removes() -> None:
    p = await running()
    stops = Stops(p, code=143)
    before = len(p.messages)
    started = time.time()
    await p.sup.stop(remove=True, reason="scaled down")
    assert p.messages[before:] == [
        f"{InstancePhase.STOPPING}/Stopping: scaled down",
        f"{InstancePhase.STOPPED}/Stopped: scaled down",
    ]
    assert (p.sup.phase, p.sup.reason, p.sup.message) == (
        InstancePhase.STOPPED,
        "Stopped",
        "scaled down",
    )
    assert p.sup.exit_code == 143
    assert p.sup.stopping is True
    assert stops.calls == [("w-0", p.sup.spec.stop_grace_seconds)]
    assert stops.removed == ["w-0"]
    assert p.sup.finished_at is not None and p.sup.finished_at >= started
    # the watch of the task ended: nothing restarts a stopped instance
    assert p.sup._task is not None and p.sup._task.done()


async def test_stop_without_remove_keeps_the_files_and_keeps_a_known_finish_time() -> None:
    p = await running()
    stops = Stops(p)
    p.sup.finished_at = 1234.5
    await p.sup.stop(remove=False, reason="")
    assert stops.removed == []
    assert p.sup.finished_at == 1234.5
    assert p.sup.phase is InstancePhase.STOPPED


async def test_concurrent_stops_stop_the_task_once() -> None:
    p = await running()
    stops = Stops(p)
    await asyncio.gather(p.sup.stop(True, "a"), p.sup.stop(True, "b"))
    assert len(stops.calls) == 1
    assert stops.removed == ["w-0"]
    assert p.sup.message == "a"


async def test_stopping_a_finished_instance_keeps_its_phase_and_exit_code() -> None:
    p = await play(RestartPolicy.NEVER, [Run(code=3)])
    assert (p.sup.phase, p.sup.exit_code) == (InstancePhase.FAILED, 3)
    stops = Stops(p, code=0)
    before = len(p.messages)
    await p.sup.stop(remove=True, reason="deleted")
    # No STOPPING/STOPPED: it had ended already; the agent is told once that it was removed.
    assert p.messages[before:] == [f"{InstancePhase.FAILED}/Error: exited with code 3"]
    assert (p.sup.phase, p.sup.exit_code) == (InstancePhase.FAILED, 3)
    assert stops.removed == ["w-0"]


@pytest.mark.parametrize(
    ("fail", "fail_remove", "logged"),
    [
        ("no such task", "", [("stop failed", "no such task")]),
        ("", "busy", [("remove failed", "busy")]),
        ("gone", "busy", [("stop failed", "gone"), ("remove failed", "busy")]),
    ],
)
async def test_a_failing_driver_is_logged_and_the_instance_still_ends_stopped(
    fail: str, fail_remove: str, logged: list[tuple[str, str]]
) -> None:
    p = await running()
    Stops(p, code=143, fail=fail, fail_remove=fail_remove)
    with structlog.testing.capture_logs() as logs:
        await p.sup.stop(remove=True, reason="drain")
    warnings = [
        (e["event"], e["error"], e["instance"], e["log_level"])
        for e in logs
        if e["event"] in ("stop failed", "remove failed")
    ]
    assert warnings == [(event, err, "w-0", "warning") for event, err in logged]
    assert (p.sup.phase, p.sup.reason) == (InstancePhase.STOPPED, "Stopped")
    # the exit code is the stop's only when the stop answered
    assert p.sup.exit_code == (None if fail else 143)
    assert p.sup.finished_at is not None


async def test_a_start_reports_starting_then_running_with_no_reason() -> None:
    p = await running()
    assert p.messages[:2] == [f"{InstancePhase.STARTING}/: ", f"{InstancePhase.RUNNING}/: "]


async def test_an_instance_never_started_closes_and_stops_cleanly() -> None:
    p = await play(RestartPolicy.NEVER, [Run(code=0)])
    fresh = type(p.sup)("w-1", 1, p.sup.spec, p.driver, lambda s: None)
    await fresh.close()
    stops = Stops(Played(fresh, p.driver, p.clock, []), code=0)
    await fresh.stop(remove=False, reason="deleted")
    assert (fresh.phase, fresh.exit_code) == (InstancePhase.STOPPED, 0)
    assert stops.calls == [("w-1", fresh.spec.stop_grace_seconds)]
