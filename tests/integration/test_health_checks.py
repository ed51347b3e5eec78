"""Health checks end to end: a real agent with the process driver runs an HTTP check against a
real HTTP server in the instance; when the check starts failing the agent restarts the
instance, and the API shows the health, the restart count and why it restarted."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration

from orka.api import controller_pb2 as pb
from orka.rpc.client import call
from tests.integration.cluster import Cluster, eventually
from tests.integration.cluster import process_spec as spec
from tests.ports import free_block

BUSYBOX = shutil.which("busybox")
pytestmark = pytest.mark.skipif(BUSYBOX is None, reason="busybox-static is not installed")

# It serves its working dir (the agent's work dir of the instance, kept across restarts) and
# writes the page the check asks for at each start.
SERVE = f'echo ok > ok; exec {BUSYBOX} httpd -f -p "127.0.0.1:$ORKA_PORT_HTTP" -h .'


def checked_spec() -> pb.WorkloadSpec:
    return spec(
        "web",
        replicas=1,
        command=["sh", "-c", SERVE],
        ports=[pb.PortSpec(name="http")],
        health_check=pb.HealthCheck(
            http=pb.HealthCheck.Http(port="http", path="/ok"),
            interval=Duration(nanos=300_000_000),
            timeout=Duration(nanos=300_000_000),
            failure_threshold=2,
        ),
    )


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    first = free_block(2)
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start()
        await c.add_agent(
            "node-1", runtimes=["process"], host_ip="127.0.0.1", host_port_range=(first, first + 1)
        )
        yield c
    finally:
        await c.stop()


async def test_a_failing_http_check_restarts_the_instance_until_it_is_healthy_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    c = cluster
    assert c.api is not None
    events: list[pb.Instance] = []

    async def watch() -> None:
        assert c.api is not None
        async for event in c.api.WatchEvents(pb.WatchEventsRequest(workload="web")):
            if event.HasField("instance"):
                events.append(event.instance)

    watcher = asyncio.create_task(watch())
    try:
        await call(c.api.CreateWorkload, pb.CreateWorkloadRequest(spec=checked_spec()))

        async def healthy(restarts: int) -> pb.Instance | None:
            running = await c.running("web")
            ok = [i for i in running if i.health == pb.Instance.HEALTHY and i.restarts == restarts]
            return ok[0] if ok else None

        inst = await eventually(lambda: healthy(0), timeout=30)
        assert inst.health_message == "" and inst.HasField("health_time")
        workload = await call(c.api.GetWorkload, pb.GetWorkloadRequest(name="web"))
        assert (workload.status.running, workload.status.healthy) == (1, 1)

        # The page goes: the check fails twice in a row, the agent reports UNHEALTHY with the
        # failure and restarts it; the new start writes the page again.
        (work,) = c.data.glob(f"agents/node-1/**/work/{inst.name}")
        (work / "ok").unlink()
        again = await eventually(lambda: healthy(1), timeout=30)
        assert again.name == inst.name and again.health_message == ""

        port = inst.ports[0].host_port
        failure = f"http GET /ok on 127.0.0.1:{port}: status 404 (want 200-399)"
        unhealthy = [e for e in events if e.health == pb.Instance.UNHEALTHY]
        assert unhealthy, [(e.phase, e.health) for e in events]
        assert (unhealthy[0].phase, unhealthy[0].health_message) == (pb.Instance.RUNNING, failure)
        restart = [e for e in events if e.reason == "Unhealthy"]
        assert restart, [(e.phase, e.reason) for e in events]
        assert restart[0].phase == pb.Instance.STARTING
        assert restart[0].message == f"health check failed: {failure}; restarting in 1s"
    finally:
        watcher.cancel()
