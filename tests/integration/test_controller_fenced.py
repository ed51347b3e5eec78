"""A leader whose election key became someone else's, with its own lease still alive (as for a
leader paused past its TTL: it has not yet failed a refresh), is stopped by its first write."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.errors import NotLeader, from_rpc_error
from orka.store import EtcdStore, Put
from tests.etcd import EtcdCluster, needs_etcd
from tests.integration.cluster import Cluster, eventually, process_spec

pytestmark = needs_etcd


def condition(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def poll() -> bool:
        return check()

    return poll


@pytest.fixture
async def on_etcd(
    certs_dir: Path, tmp_path: Path, etcd: EtcdCluster, etcd_prefix: str
) -> AsyncIterator[Cluster]:
    """A controller leading on etcd, with one agent."""
    c = Cluster(certs_dir, tmp_path)
    await c.start(agents=1, store_url=etcd.url + etcd_prefix, runtimes=["fake"])
    try:
        yield c
    finally:
        await c.stop()


async def test_a_fenced_write_lands_nothing_and_ends_the_term_at_once(
    on_etcd: Cluster, etcd: EtcdCluster, etcd_prefix: str
) -> None:
    c = on_etcd
    leader = c.controller
    assert leader is not None and leader.is_leader and c.api is not None
    async with EtcdStore(etcd.endpoints, etcd_prefix) as store:
        ours = await store.get("leader", "controller")
        assert ours is not None and leader.repo.fence is not None
        assert leader.repo.fence.revision == ours.revision == leader.link.term
        # A successor's key; our lease is untouched, so only the fence can tell.
        await store.commit([Put("leader", "controller", {"id": "127.0.0.1:1"})])
        at = await store.revision()

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await c.api.CreateWorkload(
                pb.CreateWorkloadRequest(spec=process_spec("late", replicas=1)), timeout=10
            )
        error = from_rpc_error(caught.value)
        assert isinstance(error, NotLeader) and error.message.startswith("fenced:")
        # The term ended without waiting for the lease: nothing leads here any more.
        await eventually(condition(lambda: not leader.leadership.leading.is_set()), timeout=2)  # type: ignore[union-attr]
        assert not leader.is_leader and not leader.repo.writable
        assert await store.get("workloads", "late") is None
        assert await store.revision() == at
        # Let it campaign again and win, so the cluster stops cleanly.
        await store.delete("leader", "controller")
        await eventually(condition(lambda: leader.is_leader), timeout=10)


async def test_the_repo_stops_writing_in_the_turn_the_lease_is_known_lost(on_etcd: Cluster) -> None:
    leader = on_etcd.controller
    assert leader is not None and leader.is_leader and leader.election is not None
    assert leader.repo.writable and leader.repo.fence is not None
    assert leader.leadership is not None
    terms = leader.leadership.terms
    # No await between the loss and the checks: step_down has not had a turn yet, and
    # a plan started now must still be refused (the fence alone would let it try).
    leader.election.fenced()
    assert not leader.is_leader
    assert not leader.repo.writable and leader.repo.fence is None
    with pytest.raises(NotLeader):
        await leader.repo.mutate(lambda: [])
    # The key is still ours, so the next campaign wins again: a new term, writing.
    await eventually(condition(lambda: leader.leadership.terms == terms + 1), timeout=10)  # type: ignore[union-attr]
    assert leader.is_leader and leader.repo.writable
