"""Process workloads isolated from the node, for real: users, cgroups, files, /tmp.

These need what an agent in production has: root, and a writable cgroup hierarchy with the
memory and cpu controllers (cgroup v1 here and in CI; the v2 files are checked against a
directory laid out like cgroupfs in test_cgroups.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orka.errors import RuntimeFailure
from orka.models import Resources
from orka.runtime.base import TaskState
from orka.runtime.cgroups import CPU_PERIOD_US, Cgroups
from orka.runtime.process import OOM_REASON, SIGKILL_EXIT_CODE, ProcessDriver
from tests.cgroups import detect_mounts

from .conftest import _kill_leftovers, run_spec

MakeDriver = Callable[..., ProcessDriver]

CGROUP_VERSION, _ = detect_mounts() if os.geteuid() == 0 else (0, [])
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or CGROUP_VERSION == 0,
    reason="needs root and a writable memory+cpu cgroup hierarchy, as a production agent has",
)
NOBODY = 65534


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A directory outside /tmp: a workload's private /tmp would hide anything under /tmp
    (ENOENT), and these tests must see the permission check itself (EACCES)."""
    path = Path(tempfile.mkdtemp(prefix="orka-isolation-", dir="/var/tmp"))
    path.chmod(0o755)  # like /var/lib: traversable, so only the modes below protect
    yield path
    _kill_leftovers(path / "agent" / "runtime" / "process")
    shutil.rmtree(path, ignore_errors=True)


def _cgroups(driver: ProcessDriver) -> Cgroups:
    assert driver.cgroups is not None
    return driver.cgroups


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_unprivileged_workload_cannot_read_certs_or_agent_data(
    make_process_driver: MakeDriver, cgroup_parent: str, outside_tmp: Path
) -> None:
    # The layout an agent has: its certs folder and its data dir, the driver's under it.
    certs = outside_tmp / "certs"
    certs.mkdir(mode=0o700)
    (certs / "ca.key").write_text("secret")
    (certs / "ca.key").chmod(0o600)
    agent = outside_tmp / "agent"
    agent.mkdir(mode=0o711)
    (agent / "agent-state.json").write_text("{}")
    (agent / "agent-state.json").chmod(0o600)
    driver = ProcessDriver(
        agent / "runtime" / "process", poll_interval=0.05, cgroup_parent=cgroup_parent
    )
    try:
        script = (
            'id -u; id -G; cat "$1/ca.key"; echo "certs $?"; ls "$2"; echo "data $?";'
            ' cat "$2/agent-state.json"; echo "state $?"; ls "$3"; echo "instances $?";'
            ' cat "$3/web-0/stdout.log"; echo "log $?"; echo hi > own; echo "work $?"'
        )
        await driver.start(
            run_spec(command=["sh", "-c", script, "sh", str(certs), str(agent), str(driver._root)])
        )
        done = await asyncio.wait_for(driver.wait("web-0"), 10)
        out, err = driver.log_paths("web-0")
        lines = out.read_text().splitlines()
        # Runs as nobody with only nobody's group: no supplementary groups kept from root.
        assert lines[:2] == [str(NOBODY), str(NOBODY)]
        # Every read of the agent's files failed with status 1 (cat/ls: EACCES) ...
        assert lines[2:] == ["certs 1", "data 2", "state 1", "instances 2", "log 1", "work 0"]
        errors = err.read_text()
        assert errors.count("Permission denied") == 5, errors
        # ... while its own work dir was writable, and the command itself succeeded.
        assert done.exit_code == 0
        assert (driver._work / "web-0" / "own").read_text() == "hi\n"
    finally:
        await driver.close()


async def test_agent_files_are_private(make_process_driver: MakeDriver, data_dir: Path) -> None:
    driver = make_process_driver()
    await driver.start(run_spec(command=["echo", "hi"]))
    await asyncio.wait_for(driver.wait("web-0"), 10)

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    task_dir = data_dir / "instances" / "web-0"
    assert mode(data_dir) == 0o711  # traversable to work/, not listable
    assert mode(data_dir / "instances") == 0o700
    assert mode(data_dir / "work") == 0o711
    assert mode(task_dir) == 0o700
    for name in ("stdout.log", "stderr.log", "task.json", "exit.json"):
        assert mode(task_dir / name) == 0o600, name
    work = data_dir / "work" / "web-0"
    assert mode(work) == 0o700
    assert (work.stat().st_uid, work.stat().st_gid) == (NOBODY, NOBODY)


async def test_oom_killed_past_memory_limit(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    limit = 32 << 20
    # Waits for the test to look at its cgroup, then `tail` buffers an endless line.
    command = ["sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exec tail /dev/zero"]
    await driver.start(run_spec(command=command, resources=Resources(memory_bytes=limit)))
    cg = _cgroups(driver)
    mem_dir = cg.dirs("web-0")[0]
    if CGROUP_VERSION == 1:
        assert int((mem_dir / "memory.limit_in_bytes").read_text()) == limit
    else:
        assert int((mem_dir / "memory.max").read_text()) == limit
    (driver._work / "web-0" / "go").touch()
    done = await asyncio.wait_for(driver.wait("web-0"), 30)
    assert done.state is TaskState.EXITED
    assert done.exit_code == SIGKILL_EXIT_CODE
    assert done.reason == OOM_REASON
    assert "OOM killer" in done.message
    # The cgroup goes with the instance.
    assert not cg.exists("web-0")


async def test_throttled_by_cpu_limit(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    await driver.start(
        run_spec(command=["sh", "-c", "while :; do :; done"], resources=Resources(cpu_millis=100))
    )
    cg = _cgroups(driver)
    cpu_dir = cg.dirs("web-0")[-1]
    if CGROUP_VERSION == 1:
        assert int((cpu_dir / "cpu.cfs_quota_us").read_text()) == CPU_PERIOD_US // 10
        assert int((cpu_dir / "cpu.cfs_period_us").read_text()) == CPU_PERIOD_US
    else:
        assert (cpu_dir / "cpu.max").read_text().split() == [
            str(CPU_PERIOD_US // 10),
            str(CPU_PERIOD_US),
        ]

    def throttled() -> int:
        for line in (cpu_dir / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "nr_throttled":
                return int(value)
        raise AssertionError("no nr_throttled in cpu.stat")

    # A busy loop with 10 % of a CPU is throttled in (nearly) every 100 ms period, and keeps
    # being throttled.
    await _until(lambda: throttled() >= 3)
    first = throttled()
    await _until(lambda: throttled() > first)
    await driver.stop("web-0", grace=1)
    await driver.remove("web-0")
    assert not cg.exists("web-0")


async def test_zero_resources_mean_no_limit(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    await driver.start(run_spec(command=["sleep", "1000"]))
    cg = _cgroups(driver)
    mem_dir, cpu_dir = cg.dirs("web-0")[0], cg.dirs("web-0")[-1]
    if CGROUP_VERSION == 1:
        # The kernel's "unlimited" is the largest page-aligned value.
        assert int((mem_dir / "memory.limit_in_bytes").read_text()) > 1 << 60
        assert int((cpu_dir / "cpu.cfs_quota_us").read_text()) == -1
    else:
        assert (mem_dir / "memory.max").read_text().strip() == "max"
        assert (cpu_dir / "cpu.max").read_text().split()[0] == "max"
    # Still in its cgroup: the process counts there, not in the agent's.
    info = await driver.list()
    assert info[0].pid is not None
    assert await _cgroup_holds_command(cg, "web-0")
    await driver.remove("web-0")
    assert not cg.exists("web-0")


def _runs_sleep(cg: Cgroups, instance: str) -> bool:
    for pid in cg.pids(instance):
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if os.path.basename(argv0) == b"sleep":
            return True
    return False


async def _cgroup_holds_command(cg: Cgroups, instance: str) -> bool:
    """Whether the command (not the wrapper shell) runs in the instance's cgroup."""
    try:
        await _until(lambda: _runs_sleep(cg, instance), timeout=5)
    except AssertionError:
        return False
    return True


async def test_readopted_instance_keeps_its_cgroup(make_process_driver: MakeDriver) -> None:
    first = make_process_driver()
    await first.start(
        run_spec(command=["sleep", "1000"], resources=Resources(memory_bytes=64 << 20))
    )
    cg = _cgroups(first)
    assert await _cgroup_holds_command(cg, "web-0")
    await first.close()  # the agent goes away; the task keeps running
    second = make_process_driver()
    [info] = await second.list()
    assert info.state is TaskState.RUNNING
    assert second.cgroups is not None and second.cgroups.exists("web-0")
    assert await _cgroup_holds_command(second.cgroups, "web-0")
    stopped = await second.stop("web-0", grace=1)
    assert stopped.exit_code == 143
    assert not second.cgroups.exists("web-0")


async def test_private_tmp(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    marker = f"orka-private-tmp-{os.getpid()}"
    host_file = Path("/tmp") / f"{marker}-host"
    host_file.write_text("host")
    try:
        await driver.start(
            run_spec(command=["sh", "-c", f'ls -A /tmp; echo x > "/tmp/{marker}"; echo "$?"'])
        )
        assert (await asyncio.wait_for(driver.wait("web-0"), 10)).exit_code == 0
        out, _ = driver.log_paths("web-0")
        # An empty /tmp of its own (the host's file not in it), writable, and gone after.
        assert out.read_text().splitlines() == ["0"]
        assert not (Path("/tmp") / marker).exists()
    finally:
        host_file.unlink()


async def test_root_refused_unless_allowed(make_process_driver: MakeDriver) -> None:
    strict = make_process_driver()
    for user in ("root", "0"):
        refusal = strict.admit(run_spec(user=user).spec)
        assert refusal is not None and "does not allow root workloads" in refusal
        with pytest.raises(RuntimeFailure, match="does not allow root workloads"):
            await strict.start(run_spec(user=user))
    refusal = strict.admit(run_spec(user="nobody", group="root").spec)
    assert refusal is not None and "group 'root' is root" in refusal
    assert "does not exist" in (strict.admit(run_spec(user="no-such-user-xyz").spec) or "")

    allowed = make_process_driver(user="root", allow_root=True)
    assert allowed.admit(run_spec(user="root").spec) is None
    await allowed.start(run_spec(instance="web-1", command=["id", "-u"], user="root"))
    assert (await asyncio.wait_for(allowed.wait("web-1"), 10)).exit_code == 0
    assert allowed.log_paths("web-1")[0].read_text() == "0\n"


async def test_named_user_and_group(make_process_driver: MakeDriver) -> None:
    driver = make_process_driver()
    # The agent's own supplementary groups (root's disk, adm, ...) must not reach the task.
    saved = os.getgroups()
    os.setgroups([0, 4, 6])
    try:
        await driver.start(run_spec(command=["id"], user="daemon", group="nogroup"))
    finally:
        os.setgroups(saved)
    assert (await asyncio.wait_for(driver.wait("web-0"), 10)).exit_code == 0
    out, _ = driver.log_paths("web-0")
    assert out.read_text().strip() == "uid=1(daemon) gid=65534(nogroup) groups=65534(nogroup)"


_UNPRIVILEGED_AGENT = """
import asyncio, concurrent.futures.thread, json, os, sys
from pathlib import Path
from orka.models import WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec
from orka.runtime.process import ProcessDriver

# Everything is imported while root (the venv may sit under /root); then become nobody, as an
# agent started by an unprivileged user is.
os.setgroups([])
os.setgid(65534)
os.setuid(65534)


async def main() -> dict[str, object]:
    driver = ProcessDriver(Path(sys.argv[1]), poll_interval=0.05, cgroup_parent=sys.argv[2])
    health = await driver.health()
    spec = WorkloadSpec(name="w", kind=WorkloadKind.PROCESS, command=["id", "-u"])
    await driver.start(RunSpec(instance="w-0", workload="w", spec=spec))
    done = await driver.wait("w-0")
    other = spec.model_copy(update={"user": "daemon"})
    return {
        "healthy": health.healthy,
        "message": health.message,
        "cgroups": driver.cgroups is not None,
        "exit_code": done.exit_code,
        "uid": driver.log_paths("w-0")[0].read_text().strip(),
        "admit_self": driver.admit(spec.model_copy(update={"user": "nobody"})),
        "admit_other": driver.admit(other),
        "admit_root": driver.admit(spec.model_copy(update={"user": "root"})),
    }


print(json.dumps(asyncio.run(main())))
"""


async def test_unprivileged_agent_runs_workloads_as_itself_without_limits(
    outside_tmp: Path, cgroup_parent: str
) -> None:
    import json
    import sys

    data = outside_tmp / "agent"
    data.mkdir()
    os.chown(data, NOBODY, NOBODY)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _UNPRIVILEGED_AGENT,
        str(data),
        cgroup_parent,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out.decode().splitlines()[-1])
    # It cannot write a cgroup: it says limits are off, and it keeps working.
    assert result["healthy"] is True
    assert result["message"] == "resource limits are not enforced"
    assert result["cgroups"] is False
    assert (result["exit_code"], result["uid"]) == (0, str(NOBODY))
    # It runs workloads as itself and refuses to be anyone else.
    assert result["admit_self"] is None
    assert result["admit_other"] == (
        "the agent runs as 'nobody', not root, so it cannot run a workload as user 'daemon'"
    )
    assert "cannot run a workload as user 'root'" in result["admit_root"]


async def test_without_mount_namespaces_tmp_is_shared_and_said_once(
    make_process_driver: MakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a container without CAP_SYS_ADMIN gives: the probe fails, workloads still run.
    import subprocess

    from structlog.testing import capture_logs

    from orka.runtime import process

    def refused(argv: list[str], **_: object) -> subprocess.CompletedProcess[bytes]:
        assert "--probe" in argv
        return subprocess.CompletedProcess(argv, 1, b"", b"")

    monkeypatch.setattr(process.subprocess, "run", refused)
    driver = make_process_driver()
    marker = Path("/tmp") / f"orka-shared-tmp-{os.getpid()}"
    marker.write_text("host")
    try:
        with capture_logs() as logs:
            await driver.health()
            await driver.start(run_spec(command=["cat", str(marker)]))
            done = await asyncio.wait_for(driver.wait("web-0"), 10)
        assert done.exit_code == 0
        assert driver.log_paths("web-0")[0].read_text() == "host"
        assert [e["event"] for e in logs].count("process.no_private_tmp") == 1
    finally:
        marker.unlink()


async def test_closed_driver_leaves_no_empty_parent(
    make_process_driver: MakeDriver, cgroup_parent: str
) -> None:
    driver = make_process_driver()
    await driver.start(run_spec(command=["true"]))
    await asyncio.wait_for(driver.wait("web-0"), 10)
    cg = _cgroups(driver)
    parents = {d.parent for d in cg.dirs("web-0")}
    assert all(p.is_dir() for p in parents)
    await driver.remove("web-0")
    await driver.close()
    assert not any(p.exists() for p in parents)
