"""Place over real gRPC: a large batch reaches each agent in full frames of offers."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.rpc import convert
from orka.rpc.client import secure_channel
from orka.rpc.frames import MAX_FRAME
from orka.scheduler.placer import PLACE_CHUNK, RANK_FIRST
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.tls import TlsFiles


@pytest.fixture
async def scheduler(certs_dir: Path) -> AsyncIterator[Scheduler]:
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0"),
        TlsFiles.for_service(certs_dir, "scheduler", "scheduler"),
    )
    await s.start()
    yield s
    await s.stop()


class Agent:
    """A hand-driven agent: registers, accepts every offer, and counts the frames that
    carried offers."""

    def __init__(self, s: Scheduler, certs: Path, name: str) -> None:
        self.channel = secure_channel(
            f"127.0.0.1:{s.port}", TlsFiles.for_service(certs, "agent", name), "scheduler"
        )
        self.name = name
        self.call = apb_grpc.SchedulerStub(self.channel).Connect()
        self.offer_frames: list[int] = []
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.call.write(
            apb.AgentMessage(
                register=apb.Register(
                    node=apb.NodeInfo(
                        capacity=pb.Resources(cpu_millis=1_000_000, memory_bytes=1 << 40),
                        allocatable=pb.Resources(cpu_millis=1_000_000, memory_bytes=1 << 40),
                        drivers=["fake"],
                    )
                )
            )
        )
        first = await self.call.read()
        assert first.WhichOneof("body") == "registered"
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            inner = list(msg.batch.messages) if msg.WhichOneof("body") == "batch" else [msg]
            offers = [m.offer for m in inner if m.WhichOneof("body") == "offer"]
            if not offers:
                continue
            self.offer_frames.append(len(offers))
            replies = [
                apb.AgentMessage(
                    offer_reply=apb.OfferReply(offer_id=o.offer_id, status=convert.ok_status())
                )
                for o in offers
            ]
            await self.call.write(apb.AgentMessage(batch=apb.AgentBatch(messages=replies)))

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.channel.close()


async def test_a_batch_of_many_chunks_sends_each_node_its_offers_together(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    """The first round yields to the event loop between chunks of PLACE_CHUNK instances;
    the offers are held until the round ends, so a node gets them all at once: in full
    frames (MAX_FRAME messages) and one last, not in a partial frame per chunk."""
    agents = [Agent(scheduler, certs_dir, f"node-{i}") for i in range(1, 7)]
    controller = secure_channel(
        f"127.0.0.1:{scheduler.port}",
        TlsFiles.for_service(certs_dir, "controller", "controller"),
        "scheduler",
    )
    try:
        for a in agents:
            await a.start()
        count = 3 * PLACE_CHUNK + 6 * 7
        spec = pb.WorkloadSpec(
            name="web", kind=pb.WorkloadSpec.PROCESS, resources=pb.Resources(cpu_millis=1)
        )
        items = [apb.Assignment(instance=f"web-{i}", spec=spec) for i in range(count)]
        resp = await apb_grpc.SchedulerStub(controller).Place(apb.PlaceRequest(items=items))
        placed = [r.node for r in resp.results]
        assert all(placed) and len(placed) == count
        # Spread evenly, and each node's share came in full frames: a chunk alone gives a
        # node fewer offers than a frame holds.
        assert PLACE_CHUNK // len(agents) < MAX_FRAME
        share = count // len(agents)
        assert sorted(placed.count(a.name) for a in agents) == [share] * len(agents)
        full, rest = divmod(share, MAX_FRAME)
        for a in agents:
            assert a.offer_frames == [MAX_FRAME] * full + ([rest] if rest else [])
    finally:
        for a in agents:
            await a.close()
        await controller.close()


async def test_the_first_round_yields_between_chunks_and_not_after_the_last(
    scheduler: Scheduler, certs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With PLACE_CHUNK 2, four instances are ranked two by two: the event loop runs once
    between the second and the third ranking, and at no other point of the round; each is
    reserved and offered in that round, so none is ranked again."""
    monkeypatch.setattr("orka.scheduler.placer.PLACE_CHUNK", 2)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    seen: list[int] = []  # the ticker's count at each ranking
    first_offer = scheduler.placer._first_offer

    def counted(*args: Any) -> Any:
        seen.append(ticks)
        return first_offer(*args)

    monkeypatch.setattr(scheduler.placer, "_first_offer", counted)
    limits: list[int | None] = []
    rank = scheduler.pipeline.rank

    def ranked(*args: Any, limit: int | None = None) -> Any:
        limits.append(limit)
        return rank(*args, limit=limit)

    monkeypatch.setattr(scheduler.pipeline, "rank", ranked)
    agent = Agent(scheduler, certs_dir, "node-1")
    controller = secure_channel(
        f"127.0.0.1:{scheduler.port}",
        TlsFiles.for_service(certs_dir, "controller", "controller"),
        "scheduler",
    )
    tick_task = asyncio.create_task(ticker())
    try:
        await agent.start()
        spec = pb.WorkloadSpec(
            name="web", kind=pb.WorkloadSpec.PROCESS, resources=pb.Resources(cpu_millis=1)
        )
        items = [apb.Assignment(instance=f"web-{i}", spec=spec) for i in range(4)]
        resp = await apb_grpc.SchedulerStub(controller).Place(apb.PlaceRequest(items=items))
        assert [r.node for r in resp.results] == ["node-1"] * 4
        assert len(seen) == 4
        # Every first offer was accepted: each instance was ranked once, for the best few.
        assert limits == [RANK_FIRST] * 4
        assert [b > a for a, b in itertools.pairwise(seen)] == [False, True, False]
        # All four offers left in one frame, after the round.
        assert agent.offer_frames == [4]
    finally:
        tick_task.cancel()
        await agent.close()
        await controller.close()
