"""End to end, the attack of issue 11: a real `orka agent` process pointed at a "scheduler"
that holds an agent certificate (agent-node-2's) must refuse to register and run nothing the
impostor commands, and say why in its log.

The impostor is a real gRPC server speaking the scheduler's agent protocol: on a stream it
acknowledges the registration, offers one instance and, without waiting for the reply,
starts two (one that touches a marker file, one that sleeps). The control row gives the same
impostor the scheduler's certificate: then the agent does register and run them, which shows
the harness would see it if the checks let an impostor through.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.security.tls import TlsFiles
from tests.e2e.procs import ProcessCluster, host_copies, kill_host_copies
from tests.integration.cluster import eventually
from tests.integration.identities import Certs, make_certs

pytestmark = pytest.mark.e2e

WORKLOAD = "rogue"


class Impostor(apb_grpc.SchedulerServicer):
    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.streams = 0

    def _assignment(self, instance: str, command: list[str]) -> apb.Assignment:
        spec = pb.WorkloadSpec(
            name=WORKLOAD,
            kind=pb.WorkloadSpec.PROCESS,
            command=command,
            replicas=1,
            restart_policy=pb.WorkloadSpec.NEVER,
        )
        return apb.Assignment(instance=instance, generation=1, spec=spec)

    async def Connect(
        self, request_iterator: AsyncIterator[apb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[apb.SchedulerMessage]:
        self.streams += 1
        async for first in request_iterator:
            assert first.WhichOneof("body") == "register"
            break
        yield apb.SchedulerMessage(registered=apb.Registered(node="node-1", heartbeat_interval=1.0))
        touch = self._assignment(f"{WORKLOAD}-touch", ["touch", str(self.marker)])
        sleep = self._assignment(f"{WORKLOAD}-sleep", ["sleep", "300"])
        yield apb.SchedulerMessage(offer=apb.Offer(offer_id="o-1", assignment=touch))
        yield apb.SchedulerMessage(start=apb.StartInstance(command_id="c-1", assignment=touch))
        yield apb.SchedulerMessage(start=apb.StartInstance(command_id="c-2", assignment=sleep))
        async for _ in request_iterator:  # hold the stream open while the agent talks
            pass


async def _serve(certs: Certs, files: TlsFiles, impostor: Impostor) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    apb_grpc.add_SchedulerServicer_to_server(impostor, server)
    creds = grpc.ssl_server_credentials(
        [(files.key.read_bytes(), files.cert.read_bytes())],
        root_certificates=(certs.dir / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


def _events(log: Path, event: str) -> list[dict[str, object]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            found.append(entry)
    return found


@pytest.fixture
def marker() -> Iterator[Path]:
    """Where the impostor's `touch` writes. Not under /tmp (process workloads get a private
    /tmp) nor under pytest's root-only tmp_path (they run as nobody): a world-writable
    folder of its own in /var/tmp, so the control row can see the agent obey."""
    folder = Path(tempfile.mkdtemp(prefix="orka-rogue-", dir="/var/tmp"))
    folder.chmod(0o777)
    try:
        yield folder / "ran"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _touched(marker: Path) -> bool:
    return marker.exists()  # one stat: fine on the test's loop


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path)


@pytest.fixture
async def cluster(certs: Certs, tmp_path: Path) -> AsyncIterator[ProcessCluster]:
    c = ProcessCluster(certs.dir, tmp_path / "run")
    (tmp_path / "run").mkdir()
    try:
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()
        kill_host_copies(WORKLOAD)


@pytest.mark.parametrize("held", ["agent-node-2", "legacy-agent-node-2"])
async def test_agent_refuses_a_scheduler_holding_an_agent_certificate(
    cluster: ProcessCluster, certs: Certs, marker: Path, held: str
) -> None:
    # agent-node-2 as issued now (clientAuth only, no host names), and as Orka issued agent
    # certificates before (serverAuth and 127.0.0.1): both must be refused.
    files = (
        certs.legacy_agent()
        if held.startswith("legacy")
        else TlsFiles.for_service(certs.dir, "agent", "node-2")
    )
    impostor = Impostor(marker)
    server, port = await _serve(certs, files, impostor)
    try:
        cluster.scheduler_port = port
        agent = cluster.start_agent("node-1")

        async def refused_twice() -> list[dict[str, object]] | None:
            found = _events(agent.log, "refusing the scheduler")
            return found if len(found) >= 2 else None

        # Two refusals: it tried again (so the first was no fluke) and still did not go in.
        refusals = await eventually(refused_twice, timeout=30)
        assert impostor.streams == 0
        assert _events(agent.log, "registered") == []
        assert not _touched(marker)
        assert host_copies(WORKLOAD) == {}
        assert refusals[0]["level"] == "error"
        assert refusals[0]["target"] == f"127.0.0.1:{port}"
        assert str(refusals[0]["reason"]).startswith("the server's certificate ")
    finally:
        await server.stop(None)


async def test_control_the_impostor_with_a_scheduler_certificate_is_obeyed(
    cluster: ProcessCluster, certs: Certs, marker: Path
) -> None:
    """What a stolen *scheduler* key can do (revocation's business): and proof that the rows
    above would see an agent that let the impostor in."""
    impostor = Impostor(marker)
    server, port = await _serve(certs, certs.role("scheduler"), impostor)
    try:
        cluster.scheduler_port = port
        agent = cluster.start_agent("node-1")

        async def ran() -> bool:
            return _touched(marker) and len(host_copies(WORKLOAD)) == 1

        await eventually(ran, timeout=30)
        assert impostor.streams >= 1
        assert _events(agent.log, "refusing the scheduler") == []
    finally:
        await server.stop(None)
