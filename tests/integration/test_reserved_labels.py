"""A node does not pick its own `orka.io/` labels: the scheduler refuses them at
registration and sets `orka.io/node` itself, from the certificate."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.agent.service import Agent, AgentConfig
from orka.agent.stream import Stream
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.errors import Invalid
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles
from tests.integration.cluster import Cluster, eventually
from tests.integration.test_scheduler_input import register, stream_error, stub


@pytest.fixture
async def scheduler(certs_dir: Path) -> AsyncIterator[Scheduler]:
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0", register_timeout=2.0),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    await s.start()
    yield s
    await s.stop()


def with_labels(labels: dict[str, str]) -> apb.AgentMessage:
    msg = register()
    msg.register.node.labels.update(labels)
    return msg


@pytest.mark.parametrize(
    ("labels", "code", "needle"),
    [
        (
            {"orka.io/node": "other"},
            grpc.StatusCode.PERMISSION_DENIED,
            "register: node.labels 'orka.io/node': the orka.io/ prefix is set by the scheduler",
        ),
        ({"orka.io/pool": "gpu"}, grpc.StatusCode.PERMISSION_DENIED, "'orka.io/pool'"),
        ({"zone": "a\0"}, grpc.StatusCode.INVALID_ARGUMENT, "node.labels['zone']: contains a NUL"),
        ({"bad key": "a"}, grpc.StatusCode.INVALID_ARGUMENT, "is not a valid label key"),
        (
            {f"k{i}": "v" for i in range(65)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "node.labels: at most 64, got 65",
        ),
    ],
)
async def test_bad_labels_are_refused_and_nothing_is_registered(
    scheduler: Scheduler,
    certs_dir: Path,
    labels: dict[str, str],
    code: grpc.StatusCode,
    needle: str,
) -> None:
    err = await stream_error(scheduler, certs_dir, with_labels(labels))
    assert err.code() == code
    assert needle in (err.details() or "")
    assert scheduler.registry.get("node-1") is None


async def test_the_scheduler_sets_the_node_label_from_the_certificate(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    channel, api = stub(scheduler, certs_dir, "agent", "node-2")
    async with channel:
        call = api.Connect()
        await call.write(with_labels({"zone": "a"}))
        await call.read()
        node = scheduler.registry.get("node-2")
        assert node is not None
        assert node.labels == {"zone": "a", "orka.io/node": "node-2"}
        call.cancel()


class RogueStream(Stream):
    """An agent stream whose code was changed to claim another node's label; counts its
    refusals."""

    refusals: list[grpc.StatusCode]

    def register_message(self) -> apb.AgentMessage:
        msg = super().register_message()
        msg.register.node.labels["orka.io/node"] = "node-2"
        return msg

    async def session(self, target: str) -> None:
        try:
            await super().session(target)
        except grpc.aio.AioRpcError as err:
            self.refusals.append(err.code())
            raise


class RogueAgent(Agent):
    stream_class = RogueStream


async def test_a_rogue_agent_never_receives_replicas_pinned_to_another_node(
    certs_dir: Path, tmp_path: Path
) -> None:
    cluster = Cluster(certs_dir, tmp_path)
    rogue: RogueAgent | None = None
    try:
        await cluster.start(agents=0)
        assert cluster.api is not None
        pinned = pb.WorkloadSpec(
            name="pinned",
            kind=pb.WorkloadSpec.PROCESS,
            command=["sleep", "100"],
            replicas=1,
            node_selector={"orka.io/node": "node-2"},
        )
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=pinned))
        rogue = RogueAgent(
            AgentConfig(
                name="node-1",
                schedulers=[f"127.0.0.1:{cluster.scheduler.port}"],
                data_dir=tmp_path / "rogue",
                runtimes=["fake"],
                reconnect_max=0.2,
            ),
            TlsFiles.for_service(certs_dir, "agent", "node-1"),
        )
        rogue.stream.refusals = []
        await rogue.start()
        await eventually(lambda: _value(len(rogue.stream.refusals) >= 2))  # type: ignore[union-attr]
        assert set(rogue.stream.refusals) == {grpc.StatusCode.PERMISSION_DENIED}
        assert not rogue.connected.is_set()
        assert cluster.scheduler.registry.get("node-1") is None
        [inst] = await cluster.instances("pinned")
        assert (inst.phase, inst.node) == (pb.Instance.PENDING, "")
        # The real node-2 gets it: the label the scheduler sets is what pins it.
        await cluster.add_agent("node-2", runtimes=["fake"])
        [inst] = await eventually(lambda: cluster.running("pinned"))
        assert inst.node == "node-2"
        nodes = await cluster.api.ListNodes(pb.ListNodesRequest())
        assert [dict(n.labels) for n in nodes.nodes] == [{"orka.io/node": "node-2"}]
    finally:
        if rogue is not None:
            await rogue.stop()
        await cluster.stop()


def test_an_agent_refuses_reserved_labels_in_its_own_config(tmp_path: Path) -> None:
    with pytest.raises(
        Invalid, match=re.escape("--labels: orka.io/node: the orka.io/ prefix is set by")
    ):
        AgentConfig(
            name="n",
            schedulers=["127.0.0.1:1"],
            data_dir=tmp_path,
            labels={"orka.io/node": "other"},
        )


async def _value(v: bool) -> bool:
    await asyncio.sleep(0)
    return v
