"""Repo: commits split to fit etcd's per-txn limit, a lost CAS reloads, followers never write."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orka.controller.repo import MAX_TXN_OPS, Change, Repo
from orka.errors import Conflict, Unavailable
from orka.models import Instance
from orka.store.base import Fenced, Put, Require, Update
from orka.store.memory import MemoryStore


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    s = MemoryStore()
    await s.open()
    yield s
    await s.close()


def inst(i: int, **kw: object) -> Instance:
    return Instance(name=f"w-{i:04d}", workload="w", generation=1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("count", "txns"), [(1, 1), (MAX_TXN_OPS, 1), (MAX_TXN_OPS + 1, 2), (300, 3)]
)
async def test_commit_split_into_txns_of_at_most_max_ops(
    store: MemoryStore, count: int, txns: int
) -> None:
    repo = Repo(store)
    await repo.mutate(lambda: [Change("instances", f"w-{i:04d}", inst(i)) for i in range(count)])
    assert repo.writes == txns
    assert len(await store.list("instances")) == count == len(repo.instances)


async def test_lost_cas_reloads_the_cache_then_raises(store: MemoryStore) -> None:
    repo = Repo(store)
    await repo.mutate(lambda: [Change("instances", "w-0000", inst(0))])
    # Another writer (a controller that leads now) changes the instance behind our back.
    item = await store.get("instances", "w-0000")
    assert item is not None
    theirs = inst(0, node="node-b").model_dump(mode="json")
    await store.commit([Update("instances", "w-0000", theirs, item.revision)])

    with pytest.raises(Conflict):
        await repo.mutate(lambda: [Change("instances", "w-0000", inst(0, node="node-a"))])
    assert repo.reloads == 1
    assert repo.instances["w-0000"].node == "node-b"
    # The next plan starts from the truth and lands: no crash loop on the same stale revision.
    await repo.mutate(lambda: [Change("instances", "w-0000", inst(0, node="node-c"))])
    assert repo.instances["w-0000"].node == "node-c"


async def test_load_resets_and_followers_do_not_write(store: MemoryStore) -> None:
    repo = Repo(store)
    await repo.mutate(lambda: [Change("instances", "w-0001", inst(1))])
    repo.reset()
    assert not repo.instances and not repo.by_workload
    repo.writable = False
    with pytest.raises(Unavailable):
        await repo.mutate(lambda: [Change("instances", "w-0002", inst(2))])
    assert [i.name for i in await store.list("instances")] == ["w-0001"]
    await repo.load()
    assert set(repo.instances) == {"w-0001"} and repo.by_workload["w"] == {"w-0001"}
    # Reloading twice does not duplicate or keep deleted entries.
    await store.commit([])
    await repo.load()
    assert set(repo.by_workload["w"]) == {"w-0001"}


async def test_each_chunk_has_its_revision_and_the_index_follows_writes(store: MemoryStore) -> None:
    repo = Repo(store)
    repo.max_txn_ops = 2
    seen: list[tuple[str, int]] = []
    repo.listeners.append(lambda c, old: seen.append((c.name, repo.revision)))
    await repo.mutate(lambda: [Change("instances", f"w-{i:04d}", inst(i)) for i in range(5)])
    # Events of one chunk share its revision; every chunk is a commit of its own.
    revisions = [r for _, r in seen]
    assert revisions[0] == revisions[1] < revisions[2] == revisions[3] < revisions[4]
    assert repo.revision == await store.revision() == revisions[4]
    assert all(repo.revision_of("instances", n) == r for n, r in seen)
    assert [k[2] for k in repo.order["instances"]] == [f"w-{i:04d}" for i in range(5)]
    # A chunk of deletes only (deletes report no revision) still moves it.
    seen.clear()
    await repo.mutate(lambda: [Change("instances", "w-0001", None)])
    assert repo.revision == await store.revision() == seen[0][1] > revisions[4]
    assert repo.revision_of("instances", "w-0001") == 0
    assert [k[2] for k in repo.order["instances"]] == ["w-0000", "w-0002", "w-0003", "w-0004"]
    # A load takes the store's revision and rebuilds the index; reset forgets both.
    reloaded: list[int] = []
    fresh = Repo(store)
    fresh.on_reload.append(reloaded.append)
    await fresh.load()
    assert fresh.revision == repo.revision and reloaded == [repo.revision]
    assert list(fresh.order["instances"]) == list(repo.order["instances"])
    fresh.reset()
    assert fresh.revision == 0 and not fresh.order["instances"]


async def test_an_instance_written_over_by_another_of_its_name_moves_in_the_index(
    store: MemoryStore,
) -> None:
    """The index must name the key of the instance the table holds: a list walks the index and
    hands out the table's object, so a stale key puts a new instance at an old one's place."""
    repo = Repo(store)
    await repo.mutate(
        lambda: [Change("instances", f"w-{i:04d}", inst(i, created_at=i)) for i in range(3)]
    )
    await repo.mutate(lambda: [Change("instances", "w-0000", inst(0, created_at=10.0))])
    assert list(repo.order["instances"]) == [
        ("w", 1.0, "w-0001"),
        ("w", 2.0, "w-0002"),
        ("w", 10.0, "w-0000"),
    ]
    # A write that keeps the key leaves the index alone.
    await repo.mutate(lambda: [Change("instances", "w-0001", inst(1, created_at=1.0, node="n"))])
    assert len(repo.order["instances"]) == 3 and ("w", 1.0, "w-0001") in repo.order["instances"]


def _grouped(instances: dict[str, Instance]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, i in instances.items():
        if i.node:
            out.setdefault(i.node, set()).add(name)
    return out


# (instance number, its node after the write; None deletes it), one commit per inner list.
_writes = st.lists(
    st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from([None, "", "node-a", "node-b", "node-c"])),
        min_size=1,
        max_size=4,
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(batches=_writes)
async def test_the_node_index_names_each_nodes_instances_through_binds_moves_and_deletes(
    batches: list[list[tuple[int, str | None]]],
) -> None:
    """A node's re-registration reads its instances from `instances_on`: an instance missing
    there would never be found gone from its node, one left behind would be marked lost on a
    node it moved away from."""
    store = MemoryStore()
    await store.open()
    try:
        repo = Repo(store)
        for batch in batches:
            await repo.mutate(
                lambda batch=batch: [
                    Change("instances", f"w-{i:04d}", None if node is None else inst(i, node=node))
                    for i, node in batch
                ]
            )
            assert {n: set(names) for n, names in repo.by_node.items()} == _grouped(repo.instances)
            for node in ("node-a", "node-b", "node-c"):
                assert sorted(i.name for i in repo.instances_on(node)) == sorted(
                    _grouped(repo.instances).get(node, set())
                )
        fresh = Repo(store)
        await fresh.load()
        assert dict(fresh.by_node) == _grouped(fresh.instances) == _grouped(repo.instances)
        fresh.reset()
        assert not fresh.by_node and fresh.instances_on("node-a") == []
    finally:
        await store.close()


async def test_a_fenced_commit_stops_the_repo_at_once(store: MemoryStore) -> None:
    repo = Repo(store)
    held = await store.create("leader", "controller", {"id": "ctl-a"})
    repo.fence = Require("leader", "controller", held)
    fenced: list[Fenced] = []
    repo.on_fenced.append(fenced.append)
    # Fenced writes still fit etcd's limit: the fence is one op of each transaction.
    commits: list[int] = []
    commit = store.commit

    async def counting(ops):  # type: ignore[no-untyped-def]
        commits.append(len(ops))
        assert ops[0] == repo.fence
        return await commit(ops)

    store.commit = counting  # type: ignore[method-assign]
    await repo.mutate(
        lambda: [Change("instances", f"w-{i:04d}", inst(i)) for i in range(MAX_TXN_OPS)]
    )
    assert commits == [MAX_TXN_OPS, 2] and repo.writes == 2
    # A successor takes the key (our lease ran out while we were paused).
    await commit([Put("leader", "controller", {"id": "ctl-b"})])
    at = await store.revision()
    with pytest.raises(Fenced):
        await repo.mutate(lambda: [Change("instances", "w-9999", inst(9999))])
    assert len(fenced) == 1 and not repo.writable
    # No reload and retry as after a lost compare, and nothing more lands.
    assert repo.reloads == 0 and await store.revision() == at
    with pytest.raises(Unavailable):
        await repo.mutate(lambda: [Change("instances", "w-9998", inst(9998))])
    assert len(await store.list("instances")) == MAX_TXN_OPS
