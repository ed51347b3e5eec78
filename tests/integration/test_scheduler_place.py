"""Place over real gRPC: a large batch reaches each agent in full frames of offers."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc.status_pb2 import Status

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.api import controller_pb2 as pb
from orka.rpc import convert
from orka.rpc.client import secure_channel
from orka.rpc.frames import MAX_FRAME
from orka.scheduler import placer
from orka.scheduler.placer import EXPLAIN_NODES, MAX_OFFERS, PLACE_CHUNK, RANK_FIRST, request_of
from orka.scheduler.service import Scheduler, SchedulerConfig
from orka.security.issue import init_certs
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

    def __init__(
        self,
        s: Scheduler,
        certs: Path,
        name: str,
        labels: dict[str, str] | None = None,
        answer: Callable[[apb.Offer], Awaitable[Status]] | None = None,
    ) -> None:
        self.channel = secure_channel(
            f"127.0.0.1:{s.port}", TlsFiles.for_service(certs, "agent", name), "scheduler"
        )
        self.name = name
        self.labels = labels or {}
        # How it answers each offer (default: takes it at once).
        self.answer = answer
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
                        labels=self.labels,
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
            statuses = [
                convert.ok_status() if self.answer is None else await self.answer(o) for o in offers
            ]
            replies = [
                apb.AgentMessage(offer_reply=apb.OfferReply(offer_id=o.offer_id, status=status))
                for o, status in zip(offers, statuses, strict=True)
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
    sent_at: list[int] = []  # the ticker's count when the round's offers are awaited
    wait_replies = placer.replies

    def awaited(*args: Any) -> Any:
        sent_at.append(ticks)
        return wait_replies(*args)

    monkeypatch.setattr(placer, "replies", awaited)
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
        # Nor between the last ranking and the offers leaving (four is two whole chunks).
        assert sent_at == [seen[-1]]
        # All four offers left in one frame, after the round.
        assert agent.offer_frames == [4]
    finally:
        tick_task.cancel()
        await agent.close()
        await controller.close()


def web(**fields: Any) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name="web", kind=pb.WorkloadSpec.PROCESS, resources=pb.Resources(cpu_millis=1), **fields
    )


def controller_channel(scheduler: Scheduler, certs_dir: Path) -> grpc.aio.Channel:
    return secure_channel(
        f"127.0.0.1:{scheduler.port}",
        TlsFiles.for_service(certs_dir, "controller", "controller"),
        "scheduler",
    )


def test_an_assignment_asks_for_its_pool_and_class() -> None:
    req = request_of(apb.Assignment(instance="web-1", spec=web(pool="gpu", class_name="large")))
    assert (req.instance, req.workload, req.pool, req.class_name) == (
        "web-1",
        "web",
        "gpu",
        "large",
    )


class FirstRefused:
    """Shared by a test's agents: the first offer any of them gets is refused, the rest are
    taken (each after `delay` seconds)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.refused: list[str] = []

    async def __call__(self, offer: apb.Offer) -> Status:
        if not self.refused:
            self.refused.append(offer.assignment.instance)
            return convert.error_status(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "full")
        await asyncio.sleep(self.delay)
        return convert.ok_status()


async def test_a_placed_instance_says_why_the_other_nodes_were_passed_over(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    """On a small cluster the result of a placed instance counts the nodes the filters left
    out, whether its first offer was taken or it went on to the next node."""
    answer = FirstRefused()
    agents = [
        Agent(scheduler, certs_dir, "node-1", {"zone": "a"}, answer),
        Agent(scheduler, certs_dir, "node-2", {"zone": "a"}, answer),
        Agent(scheduler, certs_dir, "node-3", {"zone": "b"}, answer),
    ]
    controller = controller_channel(scheduler, certs_dir)
    stub = apb_grpc.SchedulerStub(controller)
    try:
        for a in agents:
            await a.start()
        selected = web(node_selector={"zone": "a"})
        for instance in ("web-1", "web-2"):  # refused once then taken; taken at once
            resp = await stub.Place(
                apb.PlaceRequest(items=[apb.Assignment(instance=instance, spec=selected)])
            )
            (result,) = resp.results
            assert result.node in ("node-1", "node-2")
            assert [(r.code, r.node_count) for r in result.passed_over] == [
                ("NODE_SELECTOR_MISMATCH", 1)
            ]
            if instance == "web-1":
                (first,) = result.refusals
                assert first != result.node and result.refusals[first] == "refused: full"
            else:
                assert dict(result.refusals) == {}
        assert answer.refused == ["web-1"]
    finally:
        for a in agents:
            await a.close()
        await controller.close()


async def test_an_offer_answered_late_is_taken_while_the_scheduler_reads_late(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    """A scheduler that reads its streams late (`behind`) waits that much longer for an offer's
    reply, in the first round and in the node-by-node rest: a reply that comes after the
    offer timeout but within the excuse places the instance."""
    scheduler.placer.offer_timeout = 0.5
    scheduler.placer.behind = lambda: 3.0  # excused up to MAX_EXCUSE (4) timeouts: 2.5 s in all
    answer = FirstRefused(delay=1.2)
    agents = [Agent(scheduler, certs_dir, f"node-{n}", answer=answer) for n in (1, 2)]
    controller = controller_channel(scheduler, certs_dir)
    stub = apb_grpc.SchedulerStub(controller)
    try:
        for a in agents:
            await a.start()
        for instance in ("web-1", "web-2"):  # refused, then late on the next node; late at once
            resp = await stub.Place(
                apb.PlaceRequest(items=[apb.Assignment(instance=instance, spec=web())])
            )
            (result,) = resp.results
            assert result.node in ("node-1", "node-2"), result
            assert len(result.refusals) == (1 if instance == "web-1" else 0), result
    finally:
        for a in agents:
            await a.close()
        await controller.close()


WIDE = [f"node-{n}" for n in range(1, max(MAX_OFFERS + 2, EXPLAIN_NODES + 1) + 1)]


@pytest.fixture
async def wide(tmp_path: Path) -> AsyncIterator[tuple[Scheduler, Path]]:
    """A scheduler and certificates for more agents than the shared ones."""
    certs = tmp_path / "certs"
    init_certs(certs, nodes=WIDE)
    s = Scheduler(
        SchedulerConfig(listen="127.0.0.1:0"),
        TlsFiles.for_service(certs, "scheduler", "scheduler"),
    )
    await s.start()
    yield s, certs
    await s.stop()


def ranking_stages(scheduler: Scheduler) -> list[str]:
    """The stage of each ranking the scheduler makes from now on, in order."""
    stages: list[str] = []
    rank = scheduler.pipeline.rank

    def ranked(*args: Any, limit: int | None = None) -> Any:
        ranking = rank(*args, limit=limit)
        stages.append(ranking.stage)
        return ranking

    scheduler.pipeline.rank = ranked  # type: ignore[method-assign]
    return stages


async def place_four_in_zone_a(agents: list[Agent], controller: grpc.aio.Channel) -> Any:
    """Start `agents`, then place four instances that select zone "a" in one Place."""
    for a in agents:
        await a.start()
    selected = web(node_selector={"zone": "a"})
    items = [apb.Assignment(instance=f"web-{n}", spec=selected) for n in range(4)]
    return await apb_grpc.SchedulerStub(controller).Place(apb.PlaceRequest(items=items))


async def test_a_small_cluster_says_why_nodes_were_passed_over_when_the_index_ranked(
    wide: tuple[Scheduler, Path],
) -> None:
    """With more fitting nodes than a first ranking asks for, the snapshot's index ranks, and
    it does not count what it leaves out; up to EXPLAIN_NODES nodes that is counted anyway,
    for the record."""
    scheduler, certs_dir = wide
    agents = [
        Agent(scheduler, certs_dir, f"node-{n}", {"zone": "a" if n <= RANK_FIRST + 1 else "b"})
        for n in range(1, RANK_FIRST + 3)
    ]
    controller = controller_channel(scheduler, certs_dir)
    stages = ranking_stages(scheduler)
    try:
        resp = await place_four_in_zone_a(agents, controller)
        assert "indexed" in stages[1:]  # the case at hand
        for result in resp.results:
            assert result.node and result.node != f"node-{RANK_FIRST + 2}"
            assert [(r.code, r.node_count) for r in result.passed_over] == [
                ("NODE_SELECTOR_MISMATCH", 1)
            ], result
    finally:
        for a in agents:
            await a.close()
        await controller.close()


async def test_an_instance_is_offered_to_at_most_max_offers_nodes_per_place(
    wide: tuple[Scheduler, Path],
) -> None:
    """Every node refuses: the instance comes back unplaced after MAX_OFFERS offers, each
    refusal named, and the nodes left unoffered are not counted as refusing."""
    scheduler, certs_dir = wide

    async def no(offer: apb.Offer) -> Status:
        return convert.error_status(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "full")

    agents = [Agent(scheduler, certs_dir, name, answer=no) for name in WIDE]
    controller = controller_channel(scheduler, certs_dir)
    try:
        for a in agents:
            await a.start()
        assert len(agents) > MAX_OFFERS
        resp = await apb_grpc.SchedulerStub(controller).Place(
            apb.PlaceRequest(items=[apb.Assignment(instance="web-1", spec=web())])
        )
        (result,) = resp.results
        assert result.node == ""
        assert len(result.refusals) == MAX_OFFERS
        assert set(result.refusals.values()) == {"refused: full"}
        assert [(r.code, r.node_count) for r in result.reasons] == [("OFFER_REFUSED", MAX_OFFERS)]
        assert sum(len(a.offer_frames) for a in agents) == MAX_OFFERS
    finally:
        for a in agents:
            await a.close()
        await controller.close()


@pytest.mark.parametrize("nodes", [EXPLAIN_NODES, EXPLAIN_NODES + 1], ids=["at", "over"])
async def test_what_the_index_left_out_is_counted_up_to_explain_nodes(
    wide: tuple[Scheduler, Path], nodes: int
) -> None:
    """Up to EXPLAIN_NODES nodes every placed instance says why the others were passed over;
    past that only when its ranking counted it anyway (an exhaustive one), never at the cost
    of filtering every node once more."""
    scheduler, certs_dir = wide
    names = WIDE[:nodes]
    agents = [
        Agent(scheduler, certs_dir, name, {"zone": "b" if name == names[-1] else "a"})
        for name in names
    ]
    controller = controller_channel(scheduler, certs_dir)
    stages = ranking_stages(scheduler)
    try:
        resp = await place_four_in_zone_a(agents, controller)
        assert len(stages) == 4 and "indexed" in stages  # one ranking each
        for stage, result in zip(stages, resp.results, strict=True):
            assert result.node and result.node != names[-1]
            counted = nodes <= EXPLAIN_NODES or stage == "exhaustive"
            want = [("NODE_SELECTOR_MISMATCH", 1)] if counted else []
            assert [(r.code, r.node_count) for r in result.passed_over] == want, (stage, result)
    finally:
        for a in agents:
            await a.close()
        await controller.close()
