"""A scheduler takes orders only from the newest controller term: a controller paused past its
lease while a successor took over is refused before any node hears of its orders."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.api import agent_pb2 as apb
from orka.api import agent_pb2_grpc as apb_grpc
from orka.errors import Conflict, from_rpc_error
from orka.scheduler.service import Scheduler
from tests.integration.cluster import eventually
from tests.integration.test_scheduler_nodes import (
    QUIET,
    HandAgent,
    controller_channel,
    start,
    start_scheduler,
)


@pytest.fixture
async def scheduler(certs_dir: Path) -> AsyncIterator[Scheduler]:
    s = await start_scheduler(certs_dir, **QUIET)
    yield s
    await s.stop()


async def test_orders_of_an_older_controller_term_are_refused(
    scheduler: Scheduler, certs_dir: Path
) -> None:
    agent = HandAgent(scheduler, certs_dir, "node-1")
    try:
        await agent.register()
        async with controller_channel(scheduler, certs_dir) as channel:
            api = apb_grpc.SchedulerStub(channel)
            # The successor (term 9) has called; the old leader (term 5) resumes and acts.
            await api.SetNode(apb.SetNodeRequest(name="node-1", leader_term=9))
            stale = [
                api.Command(apb.CommandRequest(commands=[start("node-1", "w-0")], leader_term=5)),
                api.SetNode(apb.SetNodeRequest(name="node-1", draining=True, leader_term=5)),
                api.Place(apb.PlaceRequest(leader_term=5)),
            ]
            for order in stale:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await order
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                error = from_rpc_error(caught.value)
                assert isinstance(error, Conflict) and "term 5 is stale" in error.message
            watch = api.Watch(apb.WatchClusterRequest(leader_term=5))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await watch.read()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # A session (logs, exec, console) of the old term opens nothing on the node; the
            # successor's does.
            for term in (5, 9):
                session = api.Session()
                await session.write(
                    apb.SessionRequest(
                        node="node-1", open=apb.SessionOpen(console="vm-0"), leader_term=term
                    )
                )
                if term == 5:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await session.read()
                    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "term 5 is stale" in (caught.value.details() or "")
            opened = await eventually(lambda: asyncio.sleep(0, agent.messages("session_open")))
            assert [m.session_open.console for m in opened] == ["vm-0"]
            session.cancel()
            # Nothing of it reached the node's record; the successor still gives orders.
            node = scheduler.registry.get("node-1")
            assert node is not None and not node.draining and "w-0" not in node.holds
            await api.SetNode(apb.SetNodeRequest(name="node-1", schedulable=False, leader_term=9))
            assert not scheduler.registry.get("node-1").schedulable  # type: ignore[union-attr]
    finally:
        await agent.close()
