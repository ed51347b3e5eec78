"""The shared store conformance suite on a real etcd, plus what only etcd has: watch, leases,
fail-over across members, and the leader election built on them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from orka.errors import AlreadyExists, Conflict, Invalid, NotFound, Unavailable
from orka.store import (
    Create,
    Delete,
    EtcdStore,
    Item,
    Put,
    Require,
    Store,
    Update,
    WatchEvent,
)
from orka.store.election import Election, LeaseElection, LocalElection, election_for
from orka.store.etcd_lease import GatewayLeases
from tests.etcd import EtcdCluster, needs_etcd
from tests.integration.cluster import eventually
from tests.unit.store import test_conformance as suite

pytestmark = needs_etcd

# Every conformance test, collected again here with `make_store` below pointing at etcd.
globals().update(
    {
        name: getattr(suite, name)
        for name in dir(suite)
        if name.startswith("test_") and name not in suite.LOCAL_ONLY
    }
)


@pytest.fixture
def make_store(etcd: EtcdCluster, etcd_prefix: str) -> Callable[[], Store]:
    return lambda: EtcdStore(etcd.endpoints, etcd_prefix)


@pytest.fixture
async def store(make_store: Callable[[], Store]) -> AsyncIterator[Store]:
    async with make_store() as s:
        yield s


async def next_events(it: AsyncIterator[WatchEvent], n: int) -> list[WatchEvent]:
    return [await asyncio.wait_for(anext(it), 5) for _ in range(n)]


# --- layout and etcd specifics -----------------------------------------------------------------


async def test_key_layout_and_json_values(etcd: EtcdCluster, etcd_prefix: str) -> None:
    async with EtcdStore(etcd.endpoints, etcd_prefix) as store:
        rev = await store.commit(
            [Create("workloads", "web", {"replicas": 3}), Put("nodes", "node-1", {})]
        )
        raw = await store._call(
            "kv.Range",
            suite_range(etcd_prefix.encode() + b"/"),
            idempotent=True,
        )
        assert {kv.key: kv.value for kv in raw.kvs} == {
            f"{etcd_prefix}/nodes/node-1".encode(): b"{}",
            f"{etcd_prefix}/workloads/web".encode(): b'{"replicas":3}',
        }
        assert {kv.mod_revision for kv in raw.kvs} == {rev[0]}


def suite_range(prefix: bytes) -> object:
    from aetcd import rpc

    from orka.store.etcd import prefix_range_end

    return rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))


async def test_prefixes_isolate_stores(etcd: EtcdCluster, etcd_prefix: str) -> None:
    async with (
        EtcdStore(etcd.endpoints, etcd_prefix + "/a") as a,
        EtcdStore(etcd.endpoints, etcd_prefix + "/ab") as ab,
    ):
        await a.create("workloads", "web", {"in": "a"})
        await ab.create("workloads", "web", {"in": "ab"})
        assert [i.value for i in await a.list("workloads")] == [{"in": "a"}]
        assert [i.value for i in await ab.list("workloads")] == [{"in": "ab"}]
        # Kind "node" must not see kind "nodes".
        await a.put("nodes", "n1", {})
        assert await a.list("node") == []


async def test_list_pages_through_many_keys(store: Store) -> None:
    for start in (0, 600):
        await store.commit(
            [Create("instances", f"i-{n:04}", {"n": n}) for n in range(start, start + 600)]
        )
    items = await store.list("instances")
    assert [i.value["n"] for i in items] == list(range(1200))
    assert [i.name for i in await store.list("instances", "i-11")][:2] == ["i-1100", "i-1101"]


async def test_too_many_ops_is_invalid_and_says_why(store: Store) -> None:
    r0 = await store.revision()
    with pytest.raises(Invalid, match="max-txn-ops"):
        await store.commit([Put("instances", f"i-{n}", {}) for n in range(2000)])
    assert await store.revision() == r0


async def test_txn_counter_counts_one_txn_per_commit(store: Store) -> None:
    assert isinstance(store, EtcdStore)
    before = (store.txn_count, store.txn_failed)
    await store.commit([Create("workloads", "a", {}), Create("instances", "a-1", {})])
    with pytest.raises(AlreadyExists):
        await store.create("workloads", "a", {})
    await store.get("workloads", "a")
    await store.list("workloads")
    assert (store.txn_count, store.txn_failed) == (before[0] + 2, before[1] + 1)
    # A fenced commit is still one Txn: the requirement is one more compare in it.
    held = await store.create("leader", "controller", {})
    before = (store.txn_count, store.keys_written)
    await store.commit([Require("leader", "controller", held), Create("workloads", "b", {})])
    assert (store.txn_count, store.keys_written) == (before[0] + 1, before[1] + 1)


async def test_unreachable_endpoints_raise_unavailable() -> None:
    from tests.etcd import free_port

    async with EtcdStore([f"127.0.0.1:{free_port()}"], timeout=1) as store:
        with pytest.raises(Unavailable, match="no endpoint answered"):
            await store.get("workloads", "web")


# --- watch -------------------------------------------------------------------------------------


async def test_watch_sees_commits_in_revision_order(store: Store) -> None:
    r0 = await store.revision()
    events = store.watch("instances", "web-", start_revision=r0 + 1)
    try:
        r1 = await store.create("instances", "web-1", {"v": 1})
        await store.create("instances", "db-1", {"v": 1})  # outside the prefix
        (r3,) = {
            *await store.commit(
                [Update("instances", "web-1", {"v": 2}, r1), Create("instances", "web-2", {})]
            )
        }
        await store.delete("instances", "web-1")
        got = await next_events(events, 4)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    assert [(e.name, e.revision, e.value) for e in got] == [
        ("web-1", r1, {"v": 1}),
        ("web-1", r3, {"v": 2}),
        ("web-2", r3, {}),
        ("web-1", r3 + 1, None),
    ]
    assert got[-1].deleted and not got[0].deleted


async def test_watch_from_now_and_replay_from_a_past_revision(store: Store) -> None:
    r1 = await store.create("nodes", "n1", {"v": 1})
    r2 = await store.put("nodes", "n1", {"v": 2})
    live = store.watch("nodes")
    replay = store.watch("nodes", start_revision=r1)
    try:
        # "Now" is when iteration starts (an async generator runs on first use): start it and
        # let the watch register before the next write.
        first = asyncio.create_task(next_events(live, 1))
        await asyncio.sleep(0.3)
        r3 = await store.put("nodes", "n2", {})
        assert [(e.name, e.revision) for e in await first] == [("n2", r3)]
        assert [e.revision for e in await next_events(replay, 3)] == [r1, r2, r3]
    finally:
        await live.aclose()  # type: ignore[attr-defined]
        await replay.aclose()  # type: ignore[attr-defined]


async def test_watch_of_compacted_history_is_a_conflict(store: Store) -> None:
    assert isinstance(store, EtcdStore)
    from aetcd import rpc

    await store.put("nodes", "n1", {})
    r2 = await store.put("nodes", "n1", {"v": 2})
    await store._call("kv.Compact", rpc.CompactionRequest(revision=r2), idempotent=True)
    events = store.watch("nodes", start_revision=r2 - 1)
    try:
        with pytest.raises(Conflict, match="compacted"):
            await next_events(events, 1)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


# --- leases ------------------------------------------------------------------------------------


async def test_leased_key_goes_when_the_lease_is_revoked(store: Store) -> None:
    lease = await store.grant_lease(30)
    try:
        await store.commit([Create("leader", "controller", {"id": "c1"}, lease=lease)])
        assert await store.keepalive_lease(lease) == 30
        assert await store.get("leader", "controller") is not None
    finally:
        await store.revoke_lease(lease)
    assert await store.get("leader", "controller") is None
    await store.revoke_lease(lease)  # idempotent
    with pytest.raises(NotFound, match="expired"):
        await store.keepalive_lease(lease)


async def test_leased_key_expires_without_keepalive(store: Store) -> None:
    lease = await store.grant_lease(1)
    await store.commit([Put("leader", "x", {"id": "gone-soon"}, lease=lease)])
    deadline = time.monotonic() + 10
    while await store.get("leader", "x") is not None:
        assert time.monotonic() < deadline, "leased key outlived its lease"
        await asyncio.sleep(0.2)
    with pytest.raises(NotFound):
        await store.keepalive_lease(lease)


async def test_commit_with_an_unknown_lease_fails_and_changes_nothing(store: Store) -> None:
    r0 = await store.revision()
    with pytest.raises(NotFound, match="lease"):
        await store.commit([Create("leader", "x", {}, lease=0x7E57)])
    assert await store.revision() == r0


# --- election ----------------------------------------------------------------------------------


async def test_election_one_leader_and_takeover_on_resign(store: Store) -> None:
    a = election_for(store, "controller", "ctl-a", ttl=2)
    b = election_for(store, "controller", "ctl-b", ttl=2)
    assert isinstance(a, Election) and not isinstance(a, LocalElection)
    await asyncio.wait_for(a.campaign(), 5)
    assert await b.leader() == "ctl-a"
    b_task = asyncio.create_task(b.campaign())
    await asyncio.sleep(0.3)
    assert not b_task.done()
    await a.resign()
    await asyncio.wait_for(b_task, 5)
    assert await a.leader() == "ctl-b"
    assert b.is_leader and not a.is_leader
    await b.resign()
    assert await a.leader() is None


async def test_election_takeover_when_the_leader_stops_refreshing(store: Store) -> None:
    a = election_for(store, "controller", "ctl-a", ttl=1)
    b = election_for(store, "controller", "ctl-b", ttl=1)
    await a.campaign()
    started = time.monotonic()
    b_task = asyncio.create_task(b.campaign())
    # A crashed leader: its keep-alive stops, nothing is deleted; the lease has to run out.
    await a.abandon()
    await asyncio.wait_for(b_task, 10)
    took = time.monotonic() - started
    assert await b.leader() == "ctl-b"
    assert took < 5, f"takeover took {took:.1f}s"
    await b.resign()


async def test_election_leader_learns_it_lost_the_lease(store: Store) -> None:
    a = election_for(store, "controller", "ctl-a", ttl=1)
    await a.campaign()
    assert a.lease_id is not None
    # Someone (an operator, a partition that outlived the TTL) ends the lease under the leader.
    await store.revoke_lease(a.lease_id)
    await asyncio.wait_for(a.lost.wait(), 5)
    assert not a.is_leader
    await a.resign()


async def test_a_leader_refreshes_its_lease_over_the_gateway_not_the_stores_grpc(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store's own gRPC keepalive fails (a process whose gRPC threads are swamped by TLS
    # handshakes, as a scheduler taking 5,000 agents); the leader keeps its lease all the
    # same, through the lease keeper, past more than its TTL.
    async def swamped(self: EtcdStore, lease_id: int) -> int:
        raise Unavailable("the process's gRPC is swamped")

    renewed: list[int] = []
    through_gateway = GatewayLeases.keepalive_lease

    async def counted(self: GatewayLeases, lease_id: int) -> int:
        ttl = await through_gateway(self, lease_id)
        renewed.append(ttl)
        return ttl

    monkeypatch.setattr(EtcdStore, "keepalive_lease", swamped)
    monkeypatch.setattr(GatewayLeases, "keepalive_lease", counted)
    a = election_for(store, "controller", "ctl-a", ttl=2)
    await a.campaign()
    # Refreshed every ttl/3: four of them span more than the 2 s the lease lasts unrenewed.
    await eventually(lambda: asyncio.sleep(0, len(renewed) >= 4), timeout=10)
    assert set(renewed) == {2}
    assert a.is_leader and not a.lost.is_set()
    assert await a.leader() == "ctl-a"
    await a.resign()


async def test_a_candidate_evicts_a_dead_leader_without_waiting_for_its_lease(
    store: Store,
) -> None:
    # A 30 s lease that nobody refreshes any more (a crashed leader): b, told by other means
    # that a is dead, ends a's term and wins at once; a's lease is revoked with it.
    a = election_for(store, "scheduler", "10.0.0.1:7444", ttl=30, info={"address": "a:7444"})
    b = election_for(store, "scheduler", "10.0.0.2:7444", ttl=30, info={"address": "b:7444"})
    assert isinstance(b, LeaseElection)
    await a.campaign()
    lease = a.lease_id
    assert lease is not None
    await a.abandon()
    contender = asyncio.create_task(b.campaign())
    await eventually(lambda: asyncio.sleep(0, b.followed is not None), timeout=5)  # b follows a
    assert not await b.evict("10.0.0.1:7444")  # the identity is not the address it is reached at
    assert not await b.evict("b:7444")  # not the leader's
    assert not contender.done()
    assert await b.evict("a:7444")
    await asyncio.wait_for(contender, 5)
    assert await b.leader() == "10.0.0.2:7444" and b.followed is None
    with pytest.raises(NotFound):
        await store.keepalive_lease(lease)
    await b.resign()


async def test_an_eviction_never_ends_a_successors_term(store: Store) -> None:
    # What a candidate read of the leader is out of date: a successor at the same address (a
    # restarted scheduler elected again) holds a lease of its own, which an eviction of the
    # old term never touches.
    a = election_for(store, "scheduler", "a:7444", ttl=30)
    b = election_for(store, "scheduler", "b:7444", ttl=30)
    assert isinstance(b, LeaseElection)
    await a.campaign()
    stale = await store.get("leader", "scheduler")
    assert stale is not None
    await a.resign()
    again = election_for(store, "scheduler", "a:7444", ttl=30)
    await again.campaign()
    b.followed = stale.value
    await b.evict("a:7444")
    assert again.is_leader and await again.leader() == "a:7444"
    assert await store.keepalive_lease(again.lease_id or 0) > 0  # its lease lives on
    await again.resign()


async def test_an_election_does_not_evict_itself(store: Store) -> None:
    a = election_for(store, "scheduler", "a:7444", ttl=30)
    await a.campaign()
    assert not await a.evict("a:7444")
    assert a.is_leader and await a.leader() == "a:7444"
    await a.resign()


def block_the_loop(seconds: float) -> None:
    """The service's event loop busy with other work (a scheduler taking thousands of
    registrations) or wedged: nothing else on it runs meanwhile."""
    time.sleep(seconds)


async def test_a_leader_whose_event_loop_is_busy_past_its_ttl_keeps_its_lease(
    store: Store,
) -> None:
    # The lease is refreshed from a thread of its own; on the service's loop it would have
    # run out during the block (2 s lease, 3.5 s without a refresh).
    a = election_for(store, "controller", "ctl-a", ttl=2)
    await a.campaign()
    block_the_loop(3.5)
    await asyncio.sleep(0.2)
    assert a.is_leader and not a.lost.is_set()
    assert await a.leader() == "ctl-a"  # the key is still ours: its lease did not run out
    b = election_for(store, "controller", "ctl-b", ttl=2)
    contender = asyncio.create_task(b.campaign())
    await asyncio.sleep(0.5)
    assert not contender.done()  # nobody else can win while a's lease is kept
    contender.cancel()
    with pytest.raises(asyncio.CancelledError):
        await contender
    await a.resign()


async def test_a_leader_whose_event_loop_is_wedged_lets_its_lease_go(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past LOOP_SILENCE TTLs without its loop running, the refresher stops, so a standby can
    # take over from a leader that is alive but does nothing.
    monkeypatch.setattr("orka.store.election.LOOP_SILENCE", 1)
    a = election_for(store, "controller", "ctl-a", ttl=2)
    await a.campaign()
    block_the_loop(5.5)  # 2 s of silence allowed, then the 2 s lease runs out
    assert await a.leader() is None  # etcd expired the key while the loop was blocked
    await asyncio.wait_for(a.lost.wait(), 5)
    assert not a.is_leader
    await a.resign()


async def test_local_stores_elect_themselves(tmp_path: Path) -> None:
    from orka.store import SqliteStore

    async with SqliteStore(tmp_path / "x.db") as store:
        e = election_for(store, "controller", "ctl-a", ttl=2)
        assert isinstance(e, LocalElection)
        await e.campaign()
        assert e.is_leader and await e.leader() == "ctl-a"
        await e.resign()
        assert await e.leader() is None


# --- a 3-member cluster ------------------------------------------------------------------------


async def test_three_members_survive_the_loss_of_one(tmp_path: Path) -> None:
    with EtcdCluster(tmp_path / "etcd3", size=3) as cluster:
        async with EtcdStore(cluster.endpoints, "/ha", timeout=2) as store:
            r1 = await store.create("workloads", "web", {"v": 1})
            events = store.watch("workloads", start_revision=r1)
            try:
                assert [e.revision for e in await next_events(events, 1)] == [r1]
                # Kill the raft leader: the hard case, where writes in flight time out while
                # the others elect a new one, and the store must retry them on a live member.
                leader = await raft_leader(store)
                cluster.members[leader].stop(kill=True)
                r2 = await store.update("workloads", "web", {"v": 2}, r1)
                await store.commit([Create("instances", f"web-{n}", {}) for n in range(3)])
                assert [i.name for i in await store.list("instances")] == [
                    "web-0",
                    "web-1",
                    "web-2",
                ]
                assert await store.get("workloads", "web") == Item("workloads", "web", r2, {"v": 2})
                with pytest.raises(Conflict):
                    await store.update("workloads", "web", {"v": 3}, r1)
                lease = await store.grant_lease(5)
                await store.keepalive_lease(lease)
                await store.revoke_lease(lease)
                r3 = await store.put("workloads", "db", {})
                # The watch resumes on a live member without losing or repeating events.
                got = await next_events(events, 2)
                assert [(e.name, e.revision) for e in got] == [("web", r2), ("db", r3)]
            finally:
                await events.aclose()  # type: ignore[attr-defined]


async def raft_leader(store: EtcdStore) -> int:
    from aetcd import rpc

    for index, conn in enumerate(store._conns):
        status = await conn.channel.unary_unary(
            "/etcdserverpb.Maintenance/Status",
            request_serializer=rpc.StatusRequest.SerializeToString,
            response_deserializer=rpc.StatusResponse.FromString,
        )(rpc.StatusRequest(), timeout=2)
        if status.leader == status.header.member_id:
            return index
    raise AssertionError("no raft leader among the members")


async def test_an_ambiguous_commit_is_recognised_when_it_landed(store: Store) -> None:
    assert isinstance(store, EtcdStore)
    from orka.store.base import prepare_batch

    await store.put("nodes", "gone", {})
    batch = [Create("workloads", "web", {"v": 1}), Delete("nodes", "gone")]
    (rev, _) = await store.commit(batch)
    # What a retried commit sees after its first try landed: its own writes.
    assert await store._landed(prepare_batch(batch)) == rev
    other = [Create("workloads", "web", {"v": 2}), Delete("nodes", "gone")]
    assert await store._landed(prepare_batch(other)) is None


async def test_deletes_in_one_commit_share_a_revision_on_etcd(store: Store) -> None:
    await store.commit([Put("nodes", "a", {}), Put("nodes", "b", {})])
    events = store.watch("nodes")
    try:
        pending = asyncio.create_task(next_events(events, 2))
        await asyncio.sleep(0.3)
        revs = await store.commit([Delete("nodes", "a"), Delete("nodes", "b")])
        assert revs == [0, 0]
        got = await pending
        assert {e.revision for e in got} == {await store.revision()}
        assert all(e.deleted for e in got)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
