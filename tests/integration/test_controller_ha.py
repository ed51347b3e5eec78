"""Two controllers on one etcd: one leads, the other redirects; a lost lease hands over."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.cli.client import AdminClient
from orka.controller.service import Controller, ControllerConfig
from orka.errors import NotLeader, from_rpc_error
from orka.rpc.client import secure_channel
from orka.security.tls import TlsFiles
from tests.etcd import EtcdCluster, needs_etcd
from tests.integration.cluster import Cluster, eventually
from tests.integration.test_grpcurl import Grpcurl

pytestmark = needs_etcd

FAST = {"heartbeat_interval": 0.2, "node_lost_after": 1.0, "offer_timeout": 0.5}


@pytest.fixture
async def pair(
    certs_dir: Path, tmp_path: Path, etcd: EtcdCluster, etcd_prefix: str
) -> AsyncIterator[tuple[Cluster, Controller]]:
    c = Cluster(certs_dir, tmp_path, **FAST)
    await c.start(agents=2, store_url=etcd.url + etcd_prefix, runtimes=["fake"])
    standby = Controller(
        ControllerConfig(
            listen="127.0.0.1:0",
            schedulers=[f"127.0.0.1:{c.scheduler.port}"],
            store_url=etcd.url + etcd_prefix,
            data_dir=tmp_path / "standby",
            election_ttl=2,
        ),
        TlsFiles.for_service(certs_dir, "controller", "controller"),
    )
    await standby.start()
    yield c, standby
    await standby.stop()
    await c.stop()


async def health(certs: Path, port: int) -> int:
    channel = secure_channel(
        f"127.0.0.1:{port}", TlsFiles.for_service(certs, "admin", "admin"), "controller"
    )
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="orka.v1.Controller"))
        return int(resp.status)
    finally:
        await channel.close()


async def test_follower_redirects_and_takes_over_when_the_lease_is_lost(
    pair: tuple[Cluster, Controller], certs_dir: Path
) -> None:
    c, standby = pair
    leader = c.controller
    assert leader is not None and leader.is_leader and not standby.is_leader
    assert await health(certs_dir, leader.port) == health_pb2.HealthCheckResponse.SERVING
    assert await health(certs_dir, standby.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not standby.repo.instances and not standby.repo.writable

    # A follower names the leader; the CLI client follows it, from one address or a list.
    channel = secure_channel(
        f"127.0.0.1:{standby.port}", TlsFiles.for_service(certs_dir, "admin", "admin"), "controller"
    )
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.ControllerStub(channel).ListNodes(pb.ListNodesRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == f"not the leader; the leader is at 127.0.0.1:{leader.port}"
        # The address a client acts on is in the details, not the prose.
        redirect = from_rpc_error(err.value)
        assert type(redirect) is NotLeader
        assert (redirect.leader, redirect.retry_after) == (f"127.0.0.1:{leader.port}", 0.0)
    finally:
        await channel.close()
    # grpcurl prints the same details.
    shown = await Grpcurl(f"127.0.0.1:{standby.port}", certs_dir).call("ListNodes")
    assert shown.status() == "Unavailable", shown.err
    info = shown.detail("ErrorInfo")
    assert (info["reason"], info["domain"]) == ("NOT_LEADER", "orka.io"), shown.err
    assert info["metadata"] == {"leader": f"127.0.0.1:{leader.port}"}, shown.err
    assert shown.detail("RetryInfo")["retry_delay"] in ("0s", "0.000s"), shown.err
    both = f"127.0.0.1:{standby.port},127.0.0.1:{leader.port}"
    for target in (f"127.0.0.1:{standby.port}", both):
        async with AdminClient(target, certs_dir) as client:
            assert len(await client.list_nodes()) == 2
            assert client.address == f"127.0.0.1:{leader.port}"

    # The leader's lease vanishes (as if it had been partitioned away from etcd too long).
    assert leader.election is not None and leader.election.lease_id is not None
    await leader.store.revoke_lease(leader.election.lease_id)

    async def one_leader() -> Controller | None:
        leaders = [x for x in (leader, standby) if x.is_leader]
        return leaders[0] if len(leaders) == 1 else None

    await eventually(lambda: leader_changed(leader), timeout=15)
    new = await eventually(one_leader, timeout=20)
    other = standby if new is leader else leader
    assert not other.repo.writable and not other.repo.instances
    # The new leader resumed from etcd and places; the client finds it among both.
    async with AdminClient(both, certs_dir) as client:
        assert len(await client.list_nodes()) == 2
    channel = secure_channel(
        f"127.0.0.1:{new.port}", TlsFiles.for_service(certs_dir, "admin", "admin"), "controller"
    )
    api = pb_grpc.ControllerStub(channel)
    try:
        await api.CreateWorkload(
            pb.CreateWorkloadRequest(
                spec=pb.WorkloadSpec(
                    name="after", kind=pb.WorkloadSpec.PROCESS, command=["sleep", "9"], replicas=2
                )
            )
        )

        async def running() -> bool:
            resp = await api.ListInstances(pb.ListInstancesRequest(workload="after"))
            return sum(i.phase == pb.Instance.RUNNING for i in resp.instances) == 2

        await eventually(running, timeout=20)
    finally:
        await channel.close()


async def leader_changed(old: Controller) -> bool:
    assert old.leadership is not None
    return old.leadership.terms > 1 or not old.is_leader
