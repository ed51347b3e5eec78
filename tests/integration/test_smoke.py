from __future__ import annotations

from pathlib import Path

from orka.api import controller_pb2 as pb
from tests.integration.cluster import Cluster, eventually


async def test_three_replicas_run_on_three_nodes(certs_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(certs_dir, tmp_path)
    try:
        await cluster.start(agents=3, runtimes=["fake"])
        assert cluster.api is not None
        spec = pb.WorkloadSpec(
            name="web",
            kind=pb.WorkloadSpec.PROCESS,
            command=["sleep", "100"],
            replicas=3,
            resources=pb.Resources(cpu_millis=100, memory_bytes=1 << 20),
        )
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec))

        async def three() -> list[pb.Instance] | None:
            r = await cluster.running("web")
            return r if len(r) == 3 else None

        running = await eventually(three)
        assert len({i.node for i in running}) == 3
    finally:
        await cluster.stop()
