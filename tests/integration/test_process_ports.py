"""Ports of process workloads, end to end through the controller, the scheduler and a real
agent with the process driver: each replica learns its host port from ORKA_PORT_<NAME>, serves
on it, and the API reports where to reach it (ListInstances, ListEndpoints)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from orka.errors import FieldViolation, Invalid, NotFound
from orka.rpc.client import call
from orka.rpc.pages import list_all
from tests.integration.cluster import Cluster, crash, eventually
from tests.integration.cluster import process_spec as spec
from tests.ports import free_block, http_get

BUSYBOX = shutil.which("busybox")
pytestmark = pytest.mark.skipif(BUSYBOX is None, reason="busybox-static is not installed")

# Each replica writes what it was given into the directory it serves, then serves it on its
# host port: a GET of /port at a reported host port proves which instance answers there.
SERVE = (
    'echo "$ORKA_PORT_HTTP" > port; echo "$ORKA_HOST_PORT_HTTP" > host_port;'
    ' echo "$ORKA_HOST_IP" > host_ip; echo "$ORKA_INSTANCE" > name;'
    f' exec {BUSYBOX} httpd -f -p "127.0.0.1:$ORKA_PORT_HTTP" -h .'
)


def web_spec(replicas: int) -> pb.WorkloadSpec:
    return spec(
        "web", replicas=replicas, command=["sh", "-c", SERVE], ports=[pb.PortSpec(name="http")]
    )


async def scale(c: Cluster, replicas: int) -> None:
    assert c.api is not None
    await call(c.api.UpdateWorkload, pb.UpdateWorkloadRequest(spec=web_spec(replicas)))


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[Cluster, int]]:
    first = free_block(4)
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start()
        await c.add_agent(
            "node-1",
            runtimes=["process"],
            host_ip="127.0.0.1",
            host_port_range=(first, first + 3),
        )
        yield c, first
    finally:
        await c.stop()


async def test_two_replicas_on_one_node_serve_on_their_own_host_ports(
    cluster: tuple[Cluster, int],
) -> None:
    c, first = cluster
    assert c.api is not None
    await call(c.api.CreateWorkload, pb.CreateWorkloadRequest(spec=web_spec(2)))

    async def both_running() -> list[pb.Instance] | None:
        running = await c.running("web")
        return running if len(running) == 2 and all(i.ports for i in running) else None

    running = await eventually(both_running, timeout=30)
    ports = sorted(i.ports[0].host_port for i in running)
    assert len(set(ports)) == 2 and all(first <= p <= first + 3 for p in ports), ports
    for inst in running:
        (binding,) = inst.ports
        assert (binding.name, binding.port, binding.protocol) == (
            "http",
            binding.host_port,
            pb.PortSpec.TCP,
        )
        assert inst.host_ip == "127.0.0.1"
        assert inst.address == ""  # the host's network: no address of its own

        async def answers(port: int = binding.host_port) -> tuple[int, bytes] | None:
            try:
                return await asyncio.to_thread(http_get, "127.0.0.1", port, "/name")
            except OSError:
                return None

        status, body = await eventually(answers, timeout=15)
        assert (status, body.decode().strip()) == (200, inst.name)
        _, port_file = await asyncio.to_thread(http_get, "127.0.0.1", binding.host_port, "/port")
        _, host_port_file = await asyncio.to_thread(
            http_get, "127.0.0.1", binding.host_port, "/host_port"
        )
        _, ip_file = await asyncio.to_thread(http_get, "127.0.0.1", binding.host_port, "/host_ip")
        # On the host's network the port it listens on is its host port.
        assert (
            port_file.decode().strip(),
            host_port_file.decode().strip(),
            ip_file.decode().strip(),
        ) == (str(binding.host_port), str(binding.host_port), "127.0.0.1")

    # The endpoints of the workload are exactly its RUNNING instances, with the same ports,
    # also one per page.
    endpoints, _ = await list_all(
        c.api.ListEndpoints, pb.ListEndpointsRequest(workload="web", page_size=1), "endpoints"
    )
    got = sorted((e.instance, e.node, e.host_ip, e.ports[0].host_port) for e in endpoints)
    want = sorted((i.name, "node-1", "127.0.0.1", i.ports[0].host_port) for i in running)
    assert got == want

    # The agent dies (as if SIGKILLed) and a new one re-adopts both: the same host ports,
    # still answering, and a third replica gets neither of them.
    agent = c.agents.pop("node-1")
    await crash(agent)
    for driver in agent.drivers.values():
        await driver.close()
    agent.host_ports.close()
    await c.add_agent(
        "node-1", runtimes=["process"], host_ip="127.0.0.1", host_port_range=(first, first + 3)
    )
    revived = c.agents["node-1"]
    assert sorted(b.host_port for i in revived.instances.values() for b in i.ports) == ports
    for inst in running:
        status, body = await asyncio.to_thread(
            http_get, "127.0.0.1", inst.ports[0].host_port, "/name"
        )
        assert (status, body.decode().strip()) == (200, inst.name)
    await scale(c, 3)

    async def three_running() -> list[pb.Instance] | None:
        now = await c.running("web")
        return now if len(now) == 3 and all(i.ports for i in now) else None

    third = [
        i
        for i in await eventually(three_running, timeout=30)
        if i.name not in {r.name for r in running}
    ]
    assert len(third) == 1 and third[0].ports[0].host_port not in ports, third

    # Scaled to one: the stopped replicas' endpoints go, the one left stays as it was.
    await scale(c, 1)

    async def one_endpoint() -> list[pb.Endpoint] | None:
        resp = await call(c.api.ListEndpoints, pb.ListEndpointsRequest(workload="web"))
        return list(resp.endpoints) if len(resp.endpoints) == 1 else None

    (left,) = await eventually(one_endpoint, timeout=30)
    assert (left.instance, left.ports[0].host_port) in {
        (i.name, i.ports[0].host_port) for i in [*running, *third]
    }


async def test_endpoints_of_a_missing_workload_is_not_found(cluster: tuple[Cluster, int]) -> None:
    c, _ = cluster
    assert c.api is not None
    with pytest.raises(NotFound, match="workload 'nope' not found"):
        await call(c.api.ListEndpoints, pb.ListEndpointsRequest(workload="nope"))
    with pytest.raises(Invalid) as err:
        await call(c.api.ListEndpoints, pb.ListEndpointsRequest())
    assert err.value.fields == [FieldViolation("workload", "is required")]


@pytest.mark.parametrize(
    ("ports", "field", "message"),
    [
        (
            [pb.PortSpec(name="http", port=80), pb.PortSpec(name="http", port=81)],
            "spec.ports[1].name",
            "'http' is given twice",
        ),
        ([pb.PortSpec(name="http", port=0)], "spec.ports[0].port", "greater than or equal to 1"),
        ([pb.PortSpec(name="http", port=70000)], "spec.ports[0].port", "less than or equal to"),
        (
            [pb.PortSpec(name="http", port=80, protocol=7)],  # type: ignore[arg-type]
            "spec.ports[0].protocol",
            "unknown protocol 7; use TCP or UDP",
        ),
        ([pb.PortSpec(name="Web_1", port=80)], "spec.ports[0].name", "lowercase letters"),
        ([pb.PortSpec(name="a", host_port=65536)], "spec.ports[0].host_port", "less than"),
    ],
)
async def test_bad_ports_are_invalid_argument_naming_the_field(
    cluster: tuple[Cluster, int], ports: list[pb.PortSpec], field: str, message: str
) -> None:
    c, _ = cluster
    assert c.api is not None and c.controller is not None
    bad = spec("web", kind=pb.WorkloadSpec.CONTAINER, image="busybox", command=[], ports=ports)
    with pytest.raises(Invalid) as err:
        await call(c.api.CreateWorkload, pb.CreateWorkloadRequest(spec=bad))
    assert [v.field for v in err.value.fields] == [field]
    assert message in err.value.fields[0].description
    assert not c.controller.repo.workloads


async def test_a_replica_restarted_by_its_policy_keeps_its_host_port(
    cluster: tuple[Cluster, int],
) -> None:
    """The agent removes an exited task before starting it again; its port is not given back
    in between, so a crash-looping replica stays where its clients found it."""
    c, first = cluster
    assert c.api is not None
    flaky = spec(
        "flaky",
        replicas=1,
        command=["sh", "-c", "sleep 0.5; exit 3"],
        ports=[pb.PortSpec(name="http")],
    )
    await call(c.api.CreateWorkload, pb.CreateWorkloadRequest(spec=flaky))
    seen: dict[int, int] = {}

    async def restarted_twice() -> bool:
        for i in await c.instances("flaky"):
            if i.phase == pb.Instance.RUNNING and i.ports:
                seen[i.restarts] = i.ports[0].host_port
        return len(seen) >= 3

    await eventually(restarted_twice, timeout=60, interval=0.05)
    assert set(seen.values()) == {seen[min(seen)]}, seen
    assert first <= seen[min(seen)] <= first + 3
