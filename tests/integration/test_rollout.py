"""A rolling update on a real cluster (controller, scheduler, agents running real processes).

One scenario walks the steps, so the cluster boots once: a good update of 6 replicas with
max_unavailable 1 keeps at least 5 RUNNING and HEALTHY at every event and ends all on the new
spec; a bad spec (a command that exits at once) stops the rollout and rolls back to the old
spec with all 6 running, and `orka rollout history` shows the revisions; so does a spec whose
health check fails; a controller stopped
mid-rollout and started again on the same store finishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from orka.api import controller_pb2 as pb
from tests.integration.cluster import Cluster, eventually, process_spec

REPLICAS = 6
RUNNING, HEALTHY = pb.Instance.RUNNING, pb.Instance.HEALTHY
State = pb.RolloutStatus.State


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start()
        for n in (1, 2):
            await c.add_agent(f"node-{n}", runtimes=["process"])
        yield c
    finally:
        await c.stop()


def web(command: list[str]) -> pb.WorkloadSpec:
    s = process_spec("web", REPLICAS, command=command)
    s.update.CopyFrom(
        pb.UpdateStrategy(
            max_unavailable=1,
            max_surge=0,
            min_ready_seconds=1,
            progress_deadline_seconds=60,
            auto_rollback=True,
        )
    )
    return s


class Watcher:
    """Follows the workload's events from a listed revision, keeping each instance's latest
    record, and the fewest RUNNING-and-HEALTHY instances seen at any event since `arm`."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.insts: dict[str, pb.Instance] = {}
        self.armed = False
        self.fewest = REPLICAS
        self.events = 0
        self._task: asyncio.Task[None] | None = None

    def ready(self) -> int:
        return sum(1 for i in self.insts.values() if i.phase == RUNNING and i.health == HEALTHY)

    async def start(self) -> None:
        assert self.cluster.api is not None
        resp = await self.cluster.api.ListInstances(
            pb.ListInstancesRequest(workload="web", page_size=100)
        )
        self.insts = {i.name: i for i in resp.instances}
        stream = self.cluster.api.WatchEvents(
            pb.WatchEventsRequest(workload="web", since_revision=resp.revision)
        )

        async def follow() -> None:
            async for ev in stream:
                if not ev.HasField("instance"):
                    continue
                if ev.type == pb.Event.DELETED:
                    self.insts.pop(ev.instance.name, None)
                else:
                    self.insts[ev.instance.name] = ev.instance
                if self.armed:
                    self.events += 1
                    self.fewest = min(self.fewest, self.ready())

        self._task = asyncio.create_task(follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def workload(cluster: Cluster) -> pb.Workload:
    assert cluster.api is not None
    return await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="web"))


async def settled(cluster: Cluster, state: int, generation: int) -> pb.Workload | None:
    """The workload once its rollout reached `state` on `generation` with all replicas running
    that generation, else None."""
    w = await workload(cluster)
    if w.generation != generation or w.rollout.state != state:
        return None
    running = await cluster.running("web")
    if len(running) != REPLICAS or {i.generation for i in running} != {generation}:
        return None
    return w


async def orka(cluster: Cluster, *args: str) -> tuple[int, str]:
    """The real CLI (a subprocess, so this loop keeps serving)."""
    assert cluster.controller is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORKA_", "GRPC_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        *args,
        "--controller",
        f"127.0.0.1:{cluster.controller.port}",
        "--certs",
        str(cluster.certs),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode().strip()


async def test_rolling_update_rollback_and_restart_mid_rollout(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=web(["sleep", "300"])))
    await eventually(lambda: settled(cluster, State.COMPLETE, 1), timeout=30)

    # 1. A good update: never fewer than 5 ready at any event, all 6 on the new spec at the end.
    watcher = Watcher(cluster)
    await watcher.start()
    try:
        watcher.armed = True
        await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=web(["sleep", "301"])))
        await eventually(lambda: settled(cluster, State.COMPLETE, 2), timeout=60)
        assert watcher.events >= 3 * REPLICAS  # stops, starts and runs were all seen
        assert watcher.fewest >= REPLICAS - 1
        assert watcher.fewest == REPLICAS - 1  # and max_unavailable 1 was used
    finally:
        await watcher.stop()
    good = {i.name for i in await cluster.running("web")}

    # Scaling up and down restarts nothing: same generation, the untouched instances stay.
    for replicas in (REPLICAS + 1, REPLICAS):
        scaled = web(["sleep", "301"])
        scaled.replicas = replicas
        await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=scaled))

        async def scaled_to(n: int = replicas) -> set[str] | None:
            running = await cluster.running("web")
            live = [i for i in await cluster.instances("web") if i.phase != pb.Instance.STOPPED]
            ok = len(running) == n == len(live) and {i.generation for i in running} == {2}
            return {i.name for i in running} if ok else None

        names = await eventually(scaled_to, timeout=30)
        assert len(good & names) == REPLICAS  # none of the six was replaced
        assert (await workload(cluster)).generation == 2
    assert await settled(cluster, State.COMPLETE, 2) is not None

    # 2. A bad spec: it exits at once; the rollout fails and rolls back to revision 2's spec.
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=web(["sh", "-c", "exit 3"])))
    w = await eventually(lambda: settled(cluster, State.ROLLED_BACK, 4), timeout=60)
    assert list(w.spec.command) == ["sleep", "301"]
    assert w.rollout.rollback_of == 3
    running = await cluster.running("web")
    # The old instances kept running (adopted by the rollback's revision); at most
    # max_unavailable of them was replaced.
    assert len(good & {i.name for i in running}) >= REPLICAS - 1
    code, out = await orka(cluster, "rollout", "history", "web", "-o", "json")
    assert code == 0, out
    history = json.loads(out)
    assert [(h["revision"], h["command"]) for h in history] == [
        (1, ["sleep", "300"]),
        (2, ["sleep", "301"]),
        (3, ["sh", "-c", "exit 3"]),
        (4, ["sleep", "301"]),
    ]
    assert history[-1]["cause"].startswith("automatic rollback to revision 2")
    assert [h["current"] for h in history] == [False, False, False, True]
    code, out = await orka(cluster, "rollout", "status", "web", "--no-watch")
    assert code == 1, out  # rolled back
    assert out.startswith("workload/web revision 4: ROLLED_BACK, 6 of 6 updated, 6 ready")

    # 2b. A spec whose health check fails: its instance turns UNHEALTHY, the rollout fails
    # and rolls back (revision 5 fails, 6 returns to revision 4's spec).
    unhealthy = web(["sleep", "301"])
    unhealthy.health_check.CopyFrom(
        pb.HealthCheck(
            exec=pb.HealthCheck.Exec(command=["false"]),
            interval=Duration(seconds=1),
            timeout=Duration(nanos=500_000_000),
            failure_threshold=1,
        )
    )
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=unhealthy))
    w = await eventually(lambda: settled(cluster, State.ROLLED_BACK, 6), timeout=60)
    assert not w.spec.HasField("health_check") and w.rollout.rollback_of == 5
    revisions = await cluster.api.ListWorkloadRevisions(pb.ListWorkloadRevisionsRequest(name="web"))
    failed = revisions.revisions[4]
    assert failed.revision == 5 and failed.spec.HasField("health_check")
    assert (
        "unhealthy" in revisions.revisions[5].cause or "restarted" in revisions.revisions[5].cause
    )

    # 3. The controller stops mid-rollout; a new one on the same store finishes it.
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=web(["sleep", "302"])))

    async def midway() -> bool:
        return any(i.generation == 7 for i in await cluster.running("web"))

    await eventually(midway, timeout=30)
    assert cluster.controller is not None
    await cluster.controller.stop()
    await cluster.start_controller()
    w = await eventually(lambda: settled(cluster, State.COMPLETE, 7), timeout=60)
    assert list(w.spec.command) == ["sleep", "302"]
    code, out = await orka(cluster, "rollout", "status", "web", "--timeout", "10")
    assert (code, out) == (0, "workload/web revision 7: COMPLETE, 6 of 6 updated, 6 ready")

    # 4. The rollout RPCs: refusals name what is wrong and change nothing; undo, pause, resume.
    before = await workload(cluster)
    refusals = [
        (cluster.api.PauseRollout(pb.PauseRolloutRequest(name="web")), "FAILED_PRECONDITION"),
        (cluster.api.PromoteRollout(pb.PromoteRolloutRequest(name="web")), "FAILED_PRECONDITION"),
        (
            cluster.api.RollbackWorkload(pb.RollbackWorkloadRequest(name="web", revision=99)),
            "FAILED_PRECONDITION",
        ),
        (
            cluster.api.RollbackWorkload(pb.RollbackWorkloadRequest(name="web", etag="stale")),
            "ABORTED",
        ),
        (cluster.api.RollbackWorkload(pb.RollbackWorkloadRequest(name="nope")), "NOT_FOUND"),
        (cluster.api.ResumeRollout(pb.ResumeRolloutRequest(name="Bad_Name")), "INVALID_ARGUMENT"),
    ]
    for call, code in refusals:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code().name == code, err.value.details()
    assert "no revision 99 (kept: 1, 2, 3, 4, 5, 6, 7)" in str(
        await _error(
            cluster.api.RollbackWorkload(pb.RollbackWorkloadRequest(name="web", revision=99))
        )
    )
    after = await workload(cluster)
    assert (after.etag, after.generation, after.rollout) == (
        before.etag,
        before.generation,
        before.rollout,
    )
    code, out = await orka(cluster, "rollout", "undo", "web", "--to-revision", "1")
    assert (code, out) == (0, "workload/web rolling back: its spec is now revision 8")
    w = await workload(cluster)
    assert list(w.spec.command) == ["sleep", "300"] and w.rollout.state == State.PROGRESSING
    code, out = await orka(cluster, "rollout", "pause", "web")
    assert (code, out) == (0, "workload/web rollout of revision 8 paused")
    assert (await workload(cluster)).rollout.state == State.PAUSED
    await cluster.api.ResumeRollout(pb.ResumeRolloutRequest(name="web"))
    assert (await workload(cluster)).rollout.state == State.PROGRESSING
    # Six steps of at least min_ready_seconds each: not done within half a second.
    code, out = await orka(cluster, "rollout", "status", "web", "--timeout", "0.5")
    assert code == 2, out
    assert out.splitlines()[-1] == "workload/web: not done after 0.5s"


async def _error(call: object) -> str:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as err:
        return err.details() or ""
    return ""
