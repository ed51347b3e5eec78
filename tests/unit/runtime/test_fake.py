from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orka.errors import NotFound, RuntimeFailure
from orka.models import WorkloadKind
from orka.runtime.base import TaskState
from orka.runtime.fake import FakeDriver

from .conftest import run_spec


@pytest.mark.parametrize(
    ("command", "image", "kind"),
    [(["fail-start"], "", WorkloadKind.PROCESS), ([], "fail-start", WorkloadKind.CONTAINER)],
)
async def test_fail_start(command: list[str], image: str, kind: WorkloadKind) -> None:
    with pytest.raises(RuntimeFailure, match="fake: start refused"):
        await FakeDriver().start(run_spec(command=command, image=image, kind=kind))


async def test_runs_until_stopped() -> None:
    driver = FakeDriver()
    info = await driver.start(run_spec(kind=WorkloadKind.VM, image="/disk.img"))
    assert info.state is TaskState.RUNNING and info.driver == "fake"
    stopped = await driver.stop("web-0", grace=10)
    assert stopped.state is TaskState.EXITED
    assert (await driver.wait("web-0")).state is TaskState.EXITED
    assert (await driver.stop("web-0", grace=10)).exit_code == stopped.exit_code


async def test_exit_after_knob() -> None:
    driver = FakeDriver()
    await driver.start(run_spec(env={"FAKE_EXIT_AFTER": "0.05", "FAKE_EXIT_CODE": "4"}))
    info = await asyncio.wait_for(driver.wait("web-0"), 2)
    assert (info.state, info.exit_code) == (TaskState.EXITED, 4)


async def test_remove_list_and_unknown() -> None:
    driver = FakeDriver(Path("/tmp/x"))
    await driver.start(run_spec("a-0"))
    await driver.start(run_spec("a-1"))
    assert sorted(t.instance for t in await driver.list()) == ["a-0", "a-1"]
    await driver.remove("a-0")
    await driver.remove("a-0")
    assert [t.instance for t in await driver.list()] == ["a-1"]
    with pytest.raises(NotFound):
        await driver.wait("a-0")
    assert driver.log_paths("a-1")[0] == Path("/tmp/x/instances/a-1/stdout.log")
    health = await driver.health()
    assert health.healthy and set(health.kinds) == set(WorkloadKind)
    await driver.close()


async def test_thousands_of_tasks_all_exit() -> None:
    driver = FakeDriver()
    for i in range(3000):
        await driver.start(run_spec(f"w-{i}", env={"FAKE_EXIT_AFTER": "0.01"}))
    await asyncio.gather(*(driver.wait(f"w-{i}") for i in range(3000)))
    assert all(t.state is TaskState.EXITED for t in await driver.list())
