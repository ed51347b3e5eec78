from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from orka.errors import AlreadyExists, NotFound, RuntimeFailure
from orka.runtime.base import TaskState
from orka.runtime.process import ProcessDriver

from .conftest import run_spec

MakeDriver = Callable[[], ProcessDriver]


def _group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


async def test_exit_code_and_logs(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    info = await driver.start(run_spec(command=["sh", "-c", "echo hi; echo err >&2; exit 3"]))
    assert info.state is TaskState.RUNNING and info.pid
    done = await asyncio.wait_for(driver.wait("web-0"), 5)
    assert done.state is TaskState.EXITED
    assert done.exit_code == 3
    assert done.finished_at is not None
    out, err = driver.log_paths("web-0")
    assert out.read_text() == "hi\n"
    assert err.read_text() == "err\n"


async def test_env_and_working_dir(make_process_driver: MakeDriver, tmp_path: Path) -> None:
    driver = make_process_driver()
    work = tmp_path / "work"
    work.mkdir()
    spec = run_spec(
        command=["sh", "-c", 'echo "$GREETING $ORKA_INSTANCE"; pwd; echo "${SECRET:-unset}"'],
        env={"GREETING": "hello"},
        working_dir=str(work),
    )
    os.environ["SECRET"] = "agent-only"
    try:
        await driver.start(spec)
    finally:
        del os.environ["SECRET"]
    assert (await asyncio.wait_for(driver.wait("web-0"), 5)).exit_code == 0
    out, _ = driver.log_paths("web-0")
    assert out.read_text().splitlines() == ["hello web-0", str(work), "unset"]


async def test_secret_env_reaches_the_process_and_logs_are_owner_only(
    make_process_driver: MakeDriver,
) -> None:
    driver = make_process_driver()
    spec = run_spec(command=["sh", "-c", 'echo "$GREETING $TOKEN"; echo oops >&2'])
    spec = spec.model_copy(
        update={
            "spec": spec.spec.model_copy(
                update={"env": {"GREETING": "hi"}, "secret_env": {"TOKEN": "s3cr3t"}}
            )
        }
    )
    await driver.start(spec)
    assert (await asyncio.wait_for(driver.wait("web-0"), 5)).exit_code == 0
    out, err = driver.log_paths("web-0")
    assert out.read_text() == "hi s3cr3t\n"
    # What a workload prints (its secrets, say) is for the service user only.
    assert [p.stat().st_mode & 0o777 for p in (out, err)] == [0o600, 0o600]


async def test_default_working_dir_is_instance_work_dir(
    make_process_driver: MakeDriver, data_dir: Path
) -> None:
    # Its own dir under work/, apart from the agent's records and logs (instances/).
    driver = make_process_driver()
    await driver.start(run_spec(command=["pwd"]))
    await asyncio.wait_for(driver.wait("web-0"), 5)
    out, _ = driver.log_paths("web-0")
    assert out.read_text().strip() == str(data_dir / "work" / "web-0")


async def test_stop_returns_within_grace(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    await driver.start(run_spec(command=["sleep", "1000"]))
    info = await driver.stop("web-0", grace=30)
    assert info.state is TaskState.EXITED
    # 143, not 137: SIGTERM ended it within the grace period, no SIGKILL was needed.
    assert info.exit_code == 128 + signal.SIGTERM
    # Idempotent.
    assert (await driver.stop("web-0", grace=5)).exit_code == info.exit_code


async def test_stop_kills_term_trapping_group_after_grace(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    info = await driver.start(run_spec(command=["sh", "-c", 'trap "" TERM; sleep 1000']))
    assert info.pid is not None
    await asyncio.sleep(0.2)  # let the shell start its child sleep
    assert len(_group_members(info.pid)) >= 2
    began = time.monotonic()
    stopped = await driver.stop("web-0", grace=0.5)
    # It waited the grace period out before the SIGKILL (no upper bound: machines are noisy).
    assert time.monotonic() - began >= 0.5
    assert stopped.exit_code == 128 + signal.SIGKILL
    assert _group_members(info.pid) == []


async def test_leftover_background_children_are_killed(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    info = await driver.start(run_spec(command=["sh", "-c", "sleep 1000 & exit 0"]))
    assert info.pid is not None
    assert (await asyncio.wait_for(driver.wait("web-0"), 5)).exit_code == 0
    await asyncio.sleep(0.1)
    assert _group_members(info.pid) == []


@pytest.mark.parametrize(
    ("command", "needle"),
    [
        (["no-such-command-xyz"], "command 'no-such-command-xyz' not found"),
        (["/nonexistent/bin/tool"], "command '/nonexistent/bin/tool' not found"),
    ],
)
async def test_start_failures(
    make_process_driver: MakeDriver, command: list[str], needle: str
) -> None:
    driver = make_process_driver()
    with pytest.raises(RuntimeFailure, match=needle):
        await driver.start(run_spec(command=command))


async def test_missing_working_dir(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    with pytest.raises(RuntimeFailure, match="working_dir"):
        await driver.start(run_spec(working_dir="/nonexistent/dir"))


async def test_start_twice_while_running_is_refused(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    await driver.start(run_spec())
    with pytest.raises(AlreadyExists):
        await driver.start(run_spec())
    await driver.stop("web-0", grace=1)
    # An exited instance may be started again, appending to its logs.
    await driver.start(run_spec(command=["echo", "again"]))
    assert (await asyncio.wait_for(driver.wait("web-0"), 5)).exit_code == 0


async def test_readoption_after_agent_crash(make_process_driver: MakeDriver) -> None:
    first = make_process_driver()
    started = await first.start(run_spec(command=["sh", "-c", "sleep 1000"]))
    # Simulated crash: no stop, no close; a new driver takes over the same data dir.
    second = make_process_driver()
    tasks = await second.list()
    assert [(t.instance, t.state, t.pid, t.workload) for t in tasks] == [
        ("web-0", TaskState.RUNNING, started.pid, "web")
    ]
    usage = await second.usage("web-0")
    assert usage.memory_bytes > 0
    stopped = await second.stop("web-0", grace=2)
    assert stopped.state is TaskState.EXITED
    assert stopped.exit_code == 128 + signal.SIGTERM  # recorded by the wrapper
    assert started.pid is not None and _group_members(started.pid) == []


async def test_adopted_task_killed_after_grace(make_process_driver: MakeDriver) -> None:
    first = make_process_driver()
    started = await first.start(run_spec(command=["sh", "-c", 'trap "" TERM; sleep 1000']))
    await asyncio.sleep(0.2)  # let the inner shell install its trap before we signal
    second = make_process_driver()
    stopped = await second.stop("web-0", grace=0.3)
    assert stopped.exit_code == 128 + signal.SIGKILL
    assert started.pid is not None and _group_members(started.pid) == []


async def test_adopted_wait_sees_exit_code(make_process_driver: MakeDriver) -> None:
    first = make_process_driver()
    await first.start(run_spec(command=["sh", "-c", "sleep 0.3; exit 7"]))
    await first.close()  # stops watching, must not stop the task
    second = make_process_driver()
    (info,) = await second.list()
    assert info.state is TaskState.RUNNING
    done = await asyncio.wait_for(second.wait("web-0"), 5)
    assert done.exit_code == 7


async def test_exit_while_unwatched_is_reported_exited(make_process_driver: MakeDriver) -> None:
    first = make_process_driver()
    await first.start(run_spec(command=["sh", "-c", "sleep 0.2; exit 5"]))
    await first.close()
    await asyncio.sleep(0.6)
    second = make_process_driver()
    (info,) = await second.list()
    assert info.state is TaskState.EXITED
    assert info.exit_code == 5
    # The exit record is written, so a third driver agrees without the exit_code file.
    third = make_process_driver()
    assert (await third.list())[0].exit_code == 5


async def test_pid_reuse_is_not_mistaken_for_the_task(
    make_process_driver: MakeDriver, data_dir: Path
) -> None:
    first = make_process_driver()
    await first.start(run_spec(command=["true"]))
    await asyncio.wait_for(first.wait("web-0"), 5)
    task_dir = data_dir / "instances" / "web-0"
    # Pretend the recorded pid now belongs to this test process, started at another time.
    (task_dir / "exit.json").unlink()
    (task_dir / "task.json").write_text(
        f'{{"pid": {os.getpid()}, "start_ticks": 1, "workload": "web", "started_at": 0}}'
    )
    second = make_process_driver()
    (info,) = await second.list()
    assert info.state is TaskState.EXITED
    stopped = await second.stop("web-0", grace=0)  # must not signal the test process
    assert stopped.state is TaskState.EXITED


async def test_remove_stops_and_deletes_dir(
    make_process_driver: MakeDriver, data_dir: Path
) -> None:
    driver = make_process_driver()
    info = await driver.start(run_spec())
    task_dir = data_dir / "instances" / "web-0"
    assert task_dir.is_dir()
    await driver.remove("web-0")
    assert not task_dir.exists()
    assert info.pid is not None and _group_members(info.pid) == []
    assert await driver.list() == []
    await driver.remove("web-0")  # idempotent
    with pytest.raises(NotFound):
        await driver.wait("web-0")


async def test_usage_of_running_and_exited(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    await driver.start(run_spec(command=["sh", "-c", "while :; do :; done"]))
    await driver.usage("web-0")  # primes the cpu counters
    await asyncio.sleep(0.3)
    usage = await driver.usage("web-0")
    assert usage.cpu_millis > 100
    assert usage.memory_bytes > 0
    await driver.stop("web-0", grace=1)
    assert (await driver.usage("web-0")).cpu_millis == 0


async def test_health(make_process_driver: MakeDriver) -> None:
    health = await make_process_driver().health()
    assert health.healthy
    assert [k.value for k in health.kinds] == ["PROCESS"]


async def test_bad_instance_name_is_refused(make_process_driver: MakeDriver) -> None:
    from orka.errors import Invalid

    with pytest.raises(Invalid):
        await make_process_driver().start(run_spec(instance="../escape"))


async def test_without_writable_cgroups_limits_are_off_and_work_goes_on(
    make_process_driver: MakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What an unprivileged agent (or a container without cgroup access) finds.
    from structlog.testing import capture_logs

    from orka.models import Resources
    from orka.runtime import process

    monkeypatch.setattr(process, "detect", lambda parent: (None, "cgroup v1: Permission denied"))
    driver = make_process_driver()
    with capture_logs() as logs:
        health = await driver.health()
        await driver.health()
        await driver.start(
            run_spec(command=["echo", "ran"], resources=Resources(memory_bytes=1 << 20))
        )
        done = await asyncio.wait_for(driver.wait("web-0"), 10)
    assert health.healthy and health.message == "resource limits are not enforced"
    assert driver.cgroups is None
    assert done.exit_code == 0
    assert driver.log_paths("web-0")[0].read_text() == "ran\n"
    warnings = [e for e in logs if e["event"] == "process.limits_not_enforced"]
    assert [w["reason"] for w in warnings] == ["cgroup v1: Permission denied"]  # once
