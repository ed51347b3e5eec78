"""End to end, as `docker-compose down` and `up` do it: the services are OS processes, stopped
with SIGTERM all at once and started again. The agents exit at once (nothing to wait for),
and a node comes back schedulable; an operator's cordon survives its agent's restart."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.validation import NODE_LABEL
from tests.e2e.procs import ProcessCluster, nodes_ready
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

NODES = ["node-1", "node-2"]
LEAVE = ("--leave-timeout", "60")


async def _node(c: ProcessCluster, name: str) -> pb.Node:
    assert c.api is not None
    return await c.api.GetNode(pb.GetNodeRequest(name=name), timeout=5)


async def _running_on(c: ProcessCluster, workload: str, count: int) -> list[str] | None:
    nodes = sorted(i.node for i in await c.running(workload))
    return nodes if len(nodes) == count else None


async def _up(c: ProcessCluster) -> pb_grpc.ControllerStub:
    """Scheduler, controller and both agents (on the data dirs of any earlier run), all READY."""
    c.start_scheduler()
    c.start_controller()
    for name in NODES:
        c.start_agent(name, *LEAVE)
    api = await c.connect()
    await eventually(lambda: nodes_ready(c, NODES), timeout=30)
    return api


async def test_down_up_fast_and_schedulable_cordon_kept(certs_dir: Path, tmp_path: Path) -> None:
    c = ProcessCluster(certs_dir, tmp_path, runtime="fake")
    try:
        api = await _up(c)
        spec = pb.WorkloadSpec(
            name="web", kind=pb.WorkloadSpec.PROCESS, command=["sleep", "1000"], replicas=2
        )
        await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))
        assert await eventually(lambda: _running_on(c, "web", 2), timeout=30) == NODES

        # "down": every service gets SIGTERM at once; every agent is gone well within 10 s.
        began = time.monotonic()
        for svc in c.services.values():
            svc.signal(signal.SIGTERM)
        for name in NODES:
            c.services[name].wait(timeout=30)
        took = time.monotonic() - began
        for svc in c.services.values():
            svc.wait(timeout=30)
        print(f"down: both agents stopped {took:.2f}s after SIGTERM (leave timeout 60 s)")
        assert took < 10, f"agents took {took:.1f}s to stop\n{c.logs()}"

        # "up": the same data dirs; both nodes READY and schedulable (no drain kept), and the
        # workload runs on both again.
        api = await _up(c)

        async def schedulable() -> bool:
            for name in NODES:
                n = await _node(c, name)
                if not n.schedulable or n.draining or n.leaving:
                    return False
            return True

        await eventually(schedulable, timeout=30)
        assert await eventually(lambda: _running_on(c, "web", 2), timeout=30) == NODES
        pinned = pb.WorkloadSpec(
            name="pinned",
            kind=pb.WorkloadSpec.PROCESS,
            command=["sleep", "1000"],
            replicas=1,
            node_selector={NODE_LABEL: "node-2"},
        )
        await api.CreateWorkload(pb.CreateWorkloadRequest(spec=pinned))
        assert await eventually(lambda: _running_on(c, "pinned", 1), timeout=30) == ["node-2"]

        # An operator's cordon outlives its agent's SIGTERM and restart.
        await api.CordonNode(pb.CordonNodeRequest(name="node-1"))
        c.services["node-1"].signal(signal.SIGTERM)
        c.services["node-1"].wait(timeout=30)
        c.start_agent("node-1", *LEAVE)
        await eventually(lambda: nodes_ready(c, NODES), timeout=30)
        n = await _node(c, "node-1")
        assert (n.schedulable, n.draining, n.leaving) == (False, False, False)
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()
