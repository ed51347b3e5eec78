"""The containerd driver against a real containerd (Debian's 1.6 + runc) started by the tests.

The daemon (own root, state and socket under a temp dir, the CRI plugin disabled) and the busybox
OCI archive come from the session `containerd` fixture (tests/conftest.py, tests/containerd_env.py).
Skipped only when the containerd binary is missing; `.ci/run` installs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration

from orka.api import controller_pb2 as pb
from orka.errors import RuntimeFailure
from orka.models import Resources, RestartPolicy, WorkloadKind, WorkloadSpec
from orka.runtime.base import RunSpec, TaskState
from orka.runtime.containerd import ContainerdDriver
from tests.containerd_env import CGROUP_ROOT, Containerd, needs_containerd
from tests.integration.cluster import Cluster, crash, eventually

pytestmark = needs_containerd

MIB = 1 << 20


@pytest.fixture
async def driver(containerd: Containerd, tmp_path: Path) -> AsyncIterator[ContainerdDriver]:
    d = ContainerdDriver(tmp_path, **containerd.options())
    yield d
    await d.close()
    containerd.clean_namespace()


def container_spec(
    command: list[str],
    *,
    image: str,
    name: str = "box",
    memory: int = 0,
    cpu: int = 0,
    grace: float = 10.0,
) -> WorkloadSpec:
    return WorkloadSpec(
        name=name,
        kind=WorkloadKind.CONTAINER,
        image=image,
        command=command,
        resources=Resources(cpu_millis=cpu, memory_bytes=memory),
        stop_grace_seconds=grace,
        restart_policy=RestartPolicy.NEVER,
    )


def run(instance: str, spec: WorkloadSpec) -> RunSpec:
    return RunSpec(instance=instance, workload=spec.name, spec=spec)


def cgroup_file(driver: ContainerdDriver, instance: str, v2: str, v1: tuple[str, str]) -> Path:
    rel = driver.cgroups_path(instance).lstrip("/")
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return CGROUP_ROOT / rel / v2
    controller, name = v1
    return CGROUP_ROOT / controller / rel / name


def assert_nothing_left(ctd: Containerd, snapshotter: str, instance: str) -> None:
    assert ctd.ids("containers", "ls", "-q") == []
    assert ctd.ids("tasks", "ls", "-q") == []
    keys = ctd.ids("snapshots", "--snapshotter", snapshotter, "ls")
    # Only the image's own committed layer may remain; the instance's snapshot is gone.
    assert instance not in keys


# -- the driver on its own -----------------------------------------------------------------


async def test_health(driver: ContainerdDriver, tmp_path: Path) -> None:
    health = await driver.health()
    assert health.healthy, health.message
    assert health.kinds == [WorkloadKind.CONTAINER]
    missing = ContainerdDriver(tmp_path, socket=str(tmp_path / "nope.sock"))
    health = await missing.health()
    assert not health.healthy
    assert "nope.sock" in health.message and "not found" in health.message
    assert health.kinds == [WorkloadKind.CONTAINER]
    await missing.close()


async def test_output_exit_code_and_cleanup(
    driver: ContainerdDriver, containerd: Containerd
) -> None:
    spec = container_spec(
        # The pause: containerd 1.6's shim can drop the last stderr bytes of a task that exits
        # at once (seen here now and then); that race is the shim's, not what this checks.
        ["sh", "-c", "echo hello from $ORKA_INSTANCE; echo oops >&2; sleep 0.2; exit 3"],
        image=containerd.image,
    )
    started = await driver.start(run("hello-0", spec))
    assert started.state is TaskState.RUNNING and started.pid
    info = await asyncio.wait_for(driver.wait("hello-0"), 30)
    assert info.state is TaskState.EXITED
    assert info.exit_code == 3
    assert info.message == "exited with code 3"
    out, err = driver.log_paths("hello-0")

    async def logged() -> bool:
        # The shim copies output on its own; its last bytes may land just after the exit.
        text = out.read_text()
        return "hello from hello-0" in text and "oops" in err.read_text()

    await eventually(logged, timeout=5)
    # Each stream in its own file (the log writer, not the shim's interleaving file://).
    assert "oops" not in out.read_text() and "hello" not in err.read_text()
    # The exited task is still listed (its exit code survives until remove).
    assert [(t.instance, t.exit_code) for t in await driver.list()] == [("hello-0", 3)]
    await driver.remove("hello-0")
    await driver.remove("hello-0")  # idempotent
    assert await driver.list() == []
    assert not out.parent.exists()
    assert_nothing_left(containerd, await driver.snapshotter(), "hello-0")


async def test_limits_in_cgroup_and_usage(driver: ContainerdDriver, containerd: Containerd) -> None:
    spec = container_spec(
        ["sh", "-c", "while :; do :; done"], image=containerd.image, memory=64 * MIB, cpu=250
    )
    await driver.start(run("limits-0", spec))
    try:
        mem = cgroup_file(driver, "limits-0", "memory.max", ("memory", "memory.limit_in_bytes"))
        assert int(mem.read_text()) == 64 * MIB
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            quota, period = cgroup_file(driver, "limits-0", "cpu.max", ("", "")).read_text().split()
        else:
            quota = cgroup_file(driver, "limits-0", "", ("cpu", "cpu.cfs_quota_us")).read_text()
            period = cgroup_file(driver, "limits-0", "", ("cpu", "cpu.cfs_period_us")).read_text()
        assert (int(quota), int(period)) == (25_000, 100_000)
        await driver.usage("limits-0")  # first sample primes the CPU rate
        await asyncio.sleep(1.0)
        usage = await driver.usage("limits-0")
        assert usage.memory_bytes > 0
        # A busy loop held to a quarter of a CPU by the quota (no lower bound: the machine
        # may be busy enough to give it less).
        assert 0 <= usage.cpu_millis <= 400, usage
    finally:
        await driver.remove("limits-0")


async def test_stop_honours_sigterm_then_grace(
    driver: ContainerdDriver, containerd: Containerd
) -> None:
    # A shell that exits on SIGTERM stops at once, well within its grace period.
    polite = container_spec(
        ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 0.1; done"], image=containerd.image
    )
    await driver.start(run("polite-0", polite))
    await asyncio.sleep(0.3)  # let the shell install its trap
    t0 = time.monotonic()
    info = await driver.stop("polite-0", grace=5.0)
    assert time.monotonic() - t0 < 2.0
    assert info.state is TaskState.EXITED and info.exit_code == 0
    # `sleep` as the container's init ignores SIGTERM: SIGKILL after the 1 s grace.
    stubborn = container_spec(["sleep", "1000"], image=containerd.image)
    await driver.start(run("stubborn-0", stubborn))
    t0 = time.monotonic()
    info = await driver.stop("stubborn-0", grace=1.0)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 3.0, elapsed
    assert info.exit_code == 137
    assert info.message == "killed after the stop grace period"
    assert (await driver.stop("stubborn-0", grace=1.0)).exit_code == 137  # idempotent
    for name in ("polite-0", "stubborn-0"):
        await driver.remove(name)
    assert_nothing_left(containerd, await driver.snapshotter(), "stubborn-0")


async def test_new_driver_readopts_running_container(
    containerd: Containerd, tmp_path: Path
) -> None:
    first = ContainerdDriver(tmp_path, **containerd.options())
    spec = container_spec(["sleep", "1000"], image=containerd.image, name="keep")
    started = await first.start(run("keep-0", spec))
    await first.close()  # the agent goes away; the container keeps running
    second = ContainerdDriver(tmp_path, **containerd.options())
    try:
        (info,) = await second.list()
        assert (info.instance, info.workload, info.state) == ("keep-0", "keep", TaskState.RUNNING)
        assert info.pid == started.pid
        assert info.started_at == pytest.approx(started.started_at)
        stopped = await second.stop("keep-0", grace=0.5)
        assert stopped.exit_code == 137
        await second.remove("keep-0")
        assert_nothing_left(containerd, await second.snapshotter(), "keep-0")
    finally:
        await second.close()
        containerd.clean_namespace()


async def test_missing_images_fail_promptly(
    driver: ContainerdDriver, containerd: Containerd, tmp_path: Path
) -> None:
    for image in (f"oci-archive:{tmp_path}/missing.tar", "orka.invalid/nothing:1"):
        spec = container_spec(["true"], image=image)
        t0 = time.monotonic()
        with pytest.raises(RuntimeFailure) as err:
            await driver.start(run("missing-0", spec))
        assert image in err.value.message
        assert time.monotonic() - t0 < 10
    assert containerd.ids("containers", "ls", "-q") == []


async def test_bad_command_fails_and_leaves_nothing(
    driver: ContainerdDriver, containerd: Containerd
) -> None:
    spec = container_spec(["/no/such/binary"], image=containerd.image)
    with pytest.raises(RuntimeFailure) as err:
        await driver.start(run("bad-0", spec))
    assert "bad-0" in err.value.message
    assert_nothing_left(containerd, await driver.snapshotter(), "bad-0")


# -- through a scheduler and an agent ------------------------------------------------------


async def test_container_workload_end_to_end(
    containerd: Containerd, certs_dir: Path, tmp_path: Path
) -> None:
    cluster = Cluster(certs_dir, tmp_path)
    options = {"containerd": containerd.options()}
    try:
        await cluster.start(
            agents=1,
            runtimes=["containerd"],
            driver_options=options,
            allowed_paths=containerd.allowed_paths(),
        )
        assert cluster.api is not None
        spec = pb.WorkloadSpec(
            name="web",
            kind=pb.WorkloadSpec.CONTAINER,
            image=containerd.image,
            command=["sh", "-c", "echo serving from $ORKA_WORKLOAD; exec sleep 1000"],
            replicas=1,
            resources=pb.Resources(cpu_millis=100, memory_bytes=32 * MIB),
            stop_grace_period=Duration(seconds=1),
        )
        t0 = time.monotonic()
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
        (inst,) = await eventually(lambda: cluster.running("web"), interval=0.02)
        apply_to_running = time.monotonic() - t0
        print(f"\ncontainer: apply -> RUNNING in {apply_to_running:.3f}s")
        assert apply_to_running < 15

        agent = cluster.agents["node-1"]
        driver = agent.drivers["containerd"]
        assert isinstance(driver, ContainerdDriver)
        out, _ = driver.log_paths(inst.name)

        async def logged() -> bool:
            return out.exists() and "serving from web" in out.read_text()

        await eventually(logged)
        mem = cgroup_file(driver, inst.name, "memory.max", ("memory", "memory.limit_in_bytes"))
        assert int(mem.read_text()) == 32 * MIB
        pid = (await driver.list())[0].pid

        # The agent dies without stopping anything; a new one re-adopts the container.
        await crash(agent)
        await driver.close()
        del cluster.agents["node-1"]
        revived = await cluster.add_agent(
            "node-1",
            runtimes=["containerd"],
            driver_options=options,
            allowed_paths=containerd.allowed_paths(),
        )
        new_driver = revived.drivers["containerd"]
        assert new_driver is not driver
        (task,) = await new_driver.list()
        assert (task.instance, task.state, task.pid) == (inst.name, TaskState.RUNNING, pid)
        assert revived.instances[inst.name].phase.value == "RUNNING"

        # A run-once container: its exit code reaches the controller.
        once = pb.WorkloadSpec(
            name="once",
            kind=pb.WorkloadSpec.CONTAINER,
            image=containerd.image,
            command=["sh", "-c", "exit 7"],
            replicas=1,
            restart_policy=pb.WorkloadSpec.NEVER,
        )
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=once))

        async def failed() -> pb.Instance | None:
            found = [i for i in await cluster.instances("once") if i.phase == pb.Instance.FAILED]
            return found[0] if found else None

        assert (await eventually(failed)).exit_code == 7

        # Delete: stopped within the 1 s grace (sleep ignores SIGTERM) and nothing left of it.
        t0 = time.monotonic()
        await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))

        async def gone() -> bool:
            left = containerd.ids("containers", "ls", "-q")
            return not await cluster.instances("web") and inst.name not in left

        await eventually(gone)
        assert time.monotonic() - t0 < 10
        assert inst.name not in containerd.ids("tasks", "ls", "-q")
        snapshotter = await new_driver.snapshotter()
        assert inst.name not in containerd.ids("snapshots", "--snapshotter", snapshotter, "ls")
        assert not out.parent.exists()
        # Known gap outside the driver: the controller sends no remove for an instance that is
        # already FAILED/SUCCEEDED when its workload is deleted, so the agent keeps the "once"
        # container (the process driver keeps its files the same way). Cleaned up below.
        await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="once"))
    finally:
        await cluster.stop()
        containerd.clean_namespace()
