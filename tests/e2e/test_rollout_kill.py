"""A controller SIGKILLed mid-rollout: started again on the same data dir (its SQLite store),
it carries on with the rollout the workload record holds and finishes it. Real processes
(controller, scheduler, agent, and the workload's `sleep`s)."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from tests.e2e.procs import ProcessCluster, nodes_ready, run_orka
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

REPLICAS = 6
State = pb.RolloutStatus.State


def web(command: list[str]) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name="web",
        kind=pb.WorkloadSpec.PROCESS,
        command=command,
        replicas=REPLICAS,
        # Slow enough (2 s per step, one at a time) that the kill lands mid-way.
        update=pb.UpdateStrategy(max_unavailable=1, max_surge=0, min_ready_seconds=2),
    )


async def settled(c: ProcessCluster, state: int, generation: int) -> pb.Workload | None:
    assert c.api is not None
    try:
        w = await c.api.GetWorkload(pb.GetWorkloadRequest(name="web"), timeout=5)
        running = await c.running("web")
    except grpc.aio.AioRpcError:
        return None  # the controller is (re)starting
    if w.generation != generation or w.rollout.state != state:
        return None
    if len(running) != REPLICAS or {i.generation for i in running} != {generation}:
        return None
    return w


async def test_a_controller_killed_mid_rollout_finishes_it_after_restart(
    certs_dir: Path, tmp_path: Path
) -> None:
    c = ProcessCluster(certs_dir, tmp_path)
    try:
        c.start_scheduler()
        controller = c.start_controller()
        await c.connect()
        c.start_agent("node-1")
        await eventually(lambda: nodes_ready(c, ["node-1"]), timeout=30)
        assert c.api is not None
        await c.api.CreateWorkload(pb.CreateWorkloadRequest(spec=web(["sleep", "300"])))
        await eventually(lambda: settled(c, State.COMPLETE, 1), timeout=30)
        await c.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=web(["sleep", "301"])))

        async def midway() -> bool:
            running = await c.running("web")
            new = sum(1 for i in running if i.generation == 2)
            return 1 <= new < REPLICAS - 1

        await eventually(midway, timeout=30)
        controller.signal(signal.SIGKILL)
        assert controller.wait(10) == -signal.SIGKILL
        c.start_controller()
        await c.connect()
        w = await eventually(lambda: settled(c, State.COMPLETE, 2), timeout=60)
        assert list(w.spec.command) == ["sleep", "301"]
        out = (await run_orka(c, "rollout", "status", "web", "--timeout", "10")).strip()
        assert out == "workload/web revision 2: COMPLETE, 6 of 6 updated, 6 ready"
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()
