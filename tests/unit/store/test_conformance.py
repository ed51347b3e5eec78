"""Behaviour every Store backend must share; a new backend joins by adding a factory below.

Revisions are asserted relative to the store's revision when the test starts (`r0`), so the
same tests run on a shared etcd (tests/integration/test_store_etcd.py overrides `make_store`),
where other tests have already moved the global revision.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from orka.errors import AlreadyExists, Conflict, Invalid, NotFound, NotLeader
from orka.store import Create, Delete, Item, MemoryStore, Put, SqliteStore, Store, Update
from orka.store.base import Fenced, JsonText, Require, Unsupported

BACKENDS: dict[str, Callable[[Path], Store]] = {
    "memory": lambda _tmp: MemoryStore(),
    "sqlite": lambda tmp: SqliteStore(tmp / "nested" / "dir" / "orka.db"),
}


# Tests that only make sense for the local backends; the etcd module does not import them.
LOCAL_ONLY = {"test_fresh_store_starts_at_revision_zero"}


@pytest.fixture(params=sorted(BACKENDS))
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """Builds an unopened store of the backend under test; every call sees the same data."""
    factory = BACKENDS[request.param]
    return lambda: factory(tmp_path)


@pytest.fixture
async def store(make_store: Callable[[], Store]) -> AsyncIterator[Store]:
    async with make_store() as s:
        yield s


async def snapshot(store: Store, *kinds: str) -> tuple[int, list[Item]]:
    items = [item for kind in kinds for item in await store.list(kind)]
    return await store.revision(), items


def doc(**fields: Any) -> dict[str, Any]:
    return dict(fields)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
async def test_fresh_store_starts_at_revision_zero(backend: str, tmp_path: Path) -> None:
    async with BACKENDS[backend](tmp_path) as s:
        assert await s.revision() == 0
        assert await s.create("workload", "web", {}) == 1


async def test_empty_store(store: Store) -> None:
    r0 = await store.revision()
    assert await store.get("workload", "web") is None
    assert await store.list("workload") == []
    # Reads do not move the clock.
    assert await store.revision() == r0


async def test_create_then_get(store: Store) -> None:
    r0 = await store.revision()
    rev = await store.create("workload", "web", doc(replicas=3, env={"A": "1"}))
    assert rev == r0 + 1
    assert await store.get("workload", "web") == Item(
        "workload", "web", r0 + 1, {"replicas": 3, "env": {"A": "1"}}
    )
    # Same name under another kind is a different key.
    assert await store.get("instance", "web") is None


async def test_returned_values_are_copies(store: Store) -> None:
    value = doc(tags=["a"])
    await store.create("workload", "web", value)
    value["tags"].append("mutated-after-write")
    got = await store.get("workload", "web")
    assert got is not None
    got.value["tags"].append("mutated-after-read")
    again = await store.get("workload", "web")
    assert again is not None and again.value == {"tags": ["a"]}


async def test_list_filters_by_kind_and_prefix_and_sorts_by_name(store: Store) -> None:
    names = ["web-2", "web-10", "db-1", "web-1", "web", "we", "Web-1", "web-é", "web-\U0001f600"]
    await store.commit([Create("instance", n, doc(n=n)) for n in names])
    await store.create("workload", "web-9", doc())

    all_names = [i.name for i in await store.list("instance")]
    assert all_names == sorted(names)

    web = [i.name for i in await store.list("instance", prefix="web-")]
    assert web == ["web-1", "web-10", "web-2", "web-é", "web-\U0001f600"]
    assert [i.name for i in await store.list("instance", prefix="web-1")] == ["web-1", "web-10"]
    assert await store.list("instance", prefix="zzz") == []
    assert [i.name for i in await store.list("workload", prefix="web")] == ["web-9"]
    assert all(i.value == {"n": i.name} for i in await store.list("instance"))


async def test_list_prefix_edge_code_points(store: Store) -> None:
    # Prefixes whose last code point sits at an encoding boundary: a range-scan backend must not
    # compute a wrong upper bound for them.
    names = ["a\U0010ffff", "a\U0010ffffz", "b", "x\ud7ff", "x\ud7ffq", "x\ue000"]
    await store.commit([Put("node", n, doc()) for n in names])
    assert [i.name for i in await store.list("node", "a\U0010ffff")] == names[:2]
    assert [i.name for i in await store.list("node", "x\ud7ff")] == ["x\ud7ff", "x\ud7ffq"]


async def test_create_existing_raises_already_exists(store: Store) -> None:
    rev = await store.create("workload", "web", doc(v=1))
    with pytest.raises(AlreadyExists, match="workload 'web'"):
        await store.create("workload", "web", doc(v=2))
    item = await store.get("workload", "web")
    assert item == Item("workload", "web", rev, {"v": 1})
    assert await store.revision() == rev


async def test_update_with_current_revision_succeeds(store: Store) -> None:
    rev1 = await store.create("workload", "web", doc(v=1))
    rev2 = await store.update("workload", "web", doc(v=2), expected_revision=rev1)
    assert rev2 == rev1 + 1
    assert await store.get("workload", "web") == Item("workload", "web", rev2, {"v": 2})


async def test_update_with_stale_revision_conflicts_and_changes_nothing(store: Store) -> None:
    rev1 = await store.create("workload", "web", doc(v=1))
    rev2 = await store.update("workload", "web", doc(v=2), expected_revision=rev1)
    before = await snapshot(store, "workload")
    with pytest.raises(Conflict, match="workload 'web'"):
        await store.update("workload", "web", doc(v=3), expected_revision=rev1)
    assert await snapshot(store, "workload") == before
    assert before[1] == [Item("workload", "web", rev2, {"v": 2})]


async def test_unconditional_update(store: Store) -> None:
    await store.create("workload", "web", doc(v=1))
    await store.put("workload", "other", doc())
    rev = await store.update("workload", "web", doc(v=2), expected_revision=None)
    assert await store.get("workload", "web") == Item("workload", "web", rev, {"v": 2})


async def test_update_missing_raises_not_found(store: Store) -> None:
    r0 = await store.revision()
    for expected in (None, 0, 1, r0):
        with pytest.raises(NotFound, match="workload 'ghost'"):
            await store.update("workload", "ghost", doc(), expected_revision=expected)
        with pytest.raises(NotFound, match="workload 'ghost'"):
            await store.delete("workload", "ghost", expected_revision=expected)
    assert await store.revision() == r0
    assert await store.get("workload", "ghost") is None


async def test_expected_revision_zero_never_matches_an_existing_key(store: Store) -> None:
    rev = await store.create("workload", "web", doc(v=1))
    with pytest.raises(Conflict, match="workload 'web'"):
        await store.update("workload", "web", doc(v=2), expected_revision=0)
    with pytest.raises(Conflict, match="workload 'web'"):
        await store.delete("workload", "web", expected_revision=0)
    assert await store.get("workload", "web") == Item("workload", "web", rev, {"v": 1})


async def test_put_upserts(store: Store) -> None:
    rev1 = await store.put("node", "n1", doc(cpu=1))
    rev2 = await store.put("node", "n1", doc(cpu=2))
    assert rev2 > rev1
    assert await store.get("node", "n1") == Item("node", "n1", rev2, {"cpu": 2})


@pytest.mark.parametrize(
    ("failing_op", "error"),
    [
        (Create("workload", "exists", doc(v=9)), AlreadyExists),
        (Update("workload", "missing", doc(), expected_revision=None), NotFound),
        (Update("workload", "exists", doc(), expected_revision=999), Conflict),
        (Delete("workload", "missing"), NotFound),
        (Delete("workload", "exists", expected_revision=999), Conflict),
    ],
)
async def test_batch_is_all_or_nothing(
    store: Store, failing_op: Create | Update | Delete, error: type[Exception]
) -> None:
    r0 = await store.revision()
    await store.create("workload", "exists", doc(v=1))
    await store.create("instance", "keep", doc(v=1))
    before = await snapshot(store, "workload", "instance")
    batch = [
        Create("workload", "new", doc()),
        Update("instance", "keep", doc(v=2), expected_revision=r0 + 2),
        failing_op,
        Put("instance", "after", doc()),
    ]
    with pytest.raises(error, match=f"workload '{failing_op.name}'"):
        await store.commit(batch)
    assert await snapshot(store, "workload", "instance") == before
    # The store is still usable after a failed batch.
    assert await store.commit(batch[:2]) == [r0 + 3, r0 + 3]


async def test_first_failing_op_is_reported(store: Store) -> None:
    await store.create("workload", "a", doc())
    with pytest.raises(NotFound, match="'missing'"):
        await store.commit([Delete("workload", "missing"), Create("workload", "a", doc())])
    with pytest.raises(AlreadyExists, match="'a'"):
        await store.commit([Create("workload", "a", doc()), Delete("workload", "missing")])


async def test_delete(store: Store) -> None:
    rev = await store.create("workload", "a", doc())
    await store.create("workload", "b", doc())
    await store.delete("workload", "a")
    assert await store.get("workload", "a") is None

    with pytest.raises(NotFound, match="workload 'a'"):
        await store.delete("workload", "a")

    b = await store.get("workload", "b")
    assert b is not None
    with pytest.raises(Conflict, match="workload 'b'"):
        await store.delete("workload", "b", expected_revision=rev)
    assert await store.get("workload", "b") == b
    await store.delete("workload", "b", expected_revision=b.revision)
    assert await store.list("workload") == []

    # A deleted name can be created again.
    assert await store.create("workload", "a", doc(again=True)) == await store.revision()


async def test_revisions_are_global_monotonic_and_shared_within_a_commit(store: Store) -> None:
    r0 = await store.revision()
    revs = await store.commit(
        [Create("workload", "a", doc()), Put("node", "n", doc()), Create("instance", "i", doc())]
    )
    assert revs == [r0 + 1] * 3
    assert await store.revision() == r0 + 1
    assert {i.revision for k in ("workload", "node", "instance") for i in await store.list(k)} == {
        r0 + 1
    }

    revs = await store.commit(
        [Update("workload", "a", doc(v=2), expected_revision=r0 + 1), Delete("node", "n")]
    )
    assert revs == [r0 + 2, 0]
    assert await store.revision() == r0 + 2
    # Untouched keys keep the revision they were last written at.
    instance = await store.get("instance", "i")
    assert instance is not None and instance.revision == r0 + 1

    # A delete-only commit still moves the clock, like etcd.
    await store.delete("instance", "i")
    assert await store.revision() == r0 + 3

    # Failed and empty commits do not.
    with pytest.raises(NotFound):
        await store.delete("instance", "i")
    assert await store.commit([]) == []
    assert await store.revision() == r0 + 3
    assert await store.put("node", "n", doc()) == r0 + 4


async def test_large_batch_is_one_commit(store: Store) -> None:
    r0 = await store.revision()
    revs = await store.commit([Create("instance", f"i-{n:03}", doc(n=n)) for n in range(100)])
    assert revs == [r0 + 1] * 100
    items = await store.list("instance")
    assert [i.name for i in items] == [f"i-{n:03}" for n in range(100)]
    # One stale op among 100 rejects all of them.
    ops: list[Create | Update] = [
        Update("instance", f"i-{n:03}", doc(n=-n), expected_revision=r0 + 1)
        for n in range(100)
        if n != 50
    ]
    ops.append(Create("instance", "i-050", doc()))
    with pytest.raises(AlreadyExists, match="instance 'i-050'"):
        await store.commit(ops)
    assert await store.list("instance") == items
    assert await store.revision() == r0 + 1


async def test_fifty_stale_cas_updaters_exactly_one_wins(store: Store) -> None:
    rev0 = await store.create("workload", "web", doc(owner=None))
    barrier = asyncio.Barrier(50)

    async def contender(i: int) -> int | None:
        item = await store.get("workload", "web")
        assert item is not None
        # Everyone has read the same revision before anyone writes.
        await barrier.wait()
        try:
            return await store.update(
                "workload", "web", doc(owner=i), expected_revision=item.revision
            )
        except Conflict:
            return None

    results = await asyncio.gather(*(contender(i) for i in range(50)))
    winners = [i for i, r in enumerate(results) if r is not None]
    assert len(winners) == 1
    final = await store.get("workload", "web")
    assert final == Item("workload", "web", rev0 + 1, {"owner": winners[0]})
    assert await store.revision() == rev0 + 1


async def test_fifty_retrying_cas_incrementers_lose_no_update(store: Store) -> None:
    rev0 = await store.create("counter", "c", doc(n=0, writers=[]))

    async def incrementer(i: int) -> int:
        conflicts = 0
        while True:
            item = await store.get("counter", "c")
            assert item is not None
            await asyncio.sleep(0)  # let others read the same revision to force real conflicts
            value = {"n": item.value["n"] + 1, "writers": [*item.value["writers"], i]}
            try:
                await store.update("counter", "c", value, expected_revision=item.revision)
                return conflicts
            except Conflict:
                conflicts += 1

    conflicts = await asyncio.gather(*(incrementer(i) for i in range(50)))
    final = await store.get("counter", "c")
    assert final is not None
    assert final.value["n"] == 50
    assert sorted(final.value["writers"]) == list(range(50))
    # One create plus exactly one successful update per incrementer.
    assert final.revision == await store.revision() == rev0 + 50
    assert sum(conflicts) > 0


@pytest.mark.parametrize(
    ("op", "match"),
    [
        (Create("", "x", {}), "kind"),
        (Create("Workload", "x", {}), "kind"),
        (Create("work-load", "x", {}), "kind"),
        (Create("workload", "", {}), "name"),
        (Create("workload", "a\x00b", {}), "NUL"),
        (Create("workload", "\ud800", {}), "unicode"),
        (Create("workload", "x", [1, 2]), "JSON object"),  # type: ignore[arg-type]
        (Put("workload", "x", {"f": object()}), "JSON"),
        (Put("workload", "x", {"f": float("nan")}), "JSON"),
        (Put("workload", "x", JsonText("[1, 2]")), "JSON object"),
        (Update("workload", "x", {}, expected_revision=-1), "expected_revision"),
        (Delete("workload", "x", expected_revision=True), "expected_revision"),
    ],
)
async def test_invalid_ops_are_rejected_before_anything_runs(
    store: Store, op: Create | Update | Delete | Put, match: str
) -> None:
    r0 = await store.revision()
    with pytest.raises(Invalid, match=match):
        await store.commit([Put("workload", "ok", {}), op])
    assert await store.revision() == r0


async def test_encoded_values_are_stored_as_given_and_read_back_as_objects(store: Store) -> None:
    rev = (await store.commit([Create("workload", "a", JsonText('{"n":1,"s":"x"}'))]))[0]
    await store.commit([Update("workload", "a", JsonText('{"n":2}'), expected_revision=rev)])
    await store.commit([Put("workload", "b", JsonText("{}"))])
    a, b = await store.get("workload", "a"), await store.get("workload", "b")
    assert a is not None and a.value == {"n": 2}
    assert b is not None and b.value == {}


async def test_same_key_twice_in_one_commit_is_invalid(store: Store) -> None:
    r0 = await store.revision()
    with pytest.raises(Invalid, match="more than once"):
        await store.commit([Create("workload", "a", {}), Update("workload", "a", {}, None)])
    assert await store.revision() == r0


async def test_optional_capabilities_fail_clearly_when_absent(store: Store) -> None:
    if store.supports_leases:
        pytest.skip("this backend has leases (tested with its own tests)")
    r0 = await store.revision()
    with pytest.raises(Unsupported, match="no leases"):
        await store.grant_lease(5)
    with pytest.raises(Unsupported, match="no leases"):
        await store.commit([Create("workload", "a", {}, lease=7)])
    with pytest.raises(Unsupported, match="no watch"):
        store.watch("workload")
    assert await store.revision() == r0


async def test_read_arguments_are_validated(store: Store) -> None:
    with pytest.raises(Invalid):
        await store.get("Bad", "x")
    with pytest.raises(Invalid):
        await store.get("workload", "")
    with pytest.raises(Invalid):
        await store.list("bad kind")


async def test_arbitrary_names_round_trip(store: Store) -> None:
    names = ["with space", "a/b/c", "quote'\"", "%25", "\U0001f680", "new\nline", "x" * 1000]
    await store.commit([Put("node", n, doc(name=n)) for n in names])
    for n in names:
        item = await store.get("node", n)
        assert item is not None and item.value == {"name": n}
    assert [i.name for i in await store.list("node")] == sorted(names)


async def test_close_is_idempotent_and_reopen_works(make_store: Callable[[], Store]) -> None:
    s = make_store()
    await s.open()
    await s.open()
    await s.close()
    await s.close()
    with pytest.raises(RuntimeError, match="not open"):
        await s.get("workload", "x")
    with pytest.raises(RuntimeError, match="not open"):
        await s.commit([Put("workload", "x", {})])
    async with s:
        assert await s.get("workload", "x") is None


# --- Require: a condition on another key, the fence of a leader's writes -----------------------


async def test_a_held_requirement_lets_the_batch_land_and_writes_nothing_itself(
    store: Store,
) -> None:
    r0 = await store.revision()
    held = await store.create("leader", "controller", doc(id="ctl-a"))
    revisions = await store.commit(
        [Require("leader", "controller", held), Create("workload", "a", doc())]
    )
    assert revisions == [0, r0 + 2]
    assert await store.get("leader", "controller") == Item(
        "leader", "controller", held, {"id": "ctl-a"}
    )
    assert (await store.get("workload", "a")) is not None
    # A batch of requirements only is a read: it leaves the revision where it is.
    assert await store.commit([Require("leader", "controller", held)]) == [0]
    assert await store.revision() == r0 + 2


@pytest.mark.parametrize("successor", ["rewritten", "deleted", "recreated"])
async def test_a_failed_requirement_fences_the_whole_batch(store: Store, successor: str) -> None:
    held = await store.create("leader", "controller", doc(id="ctl-a"))
    await store.create("workload", "exists", doc(v=1))
    if successor == "rewritten":
        await store.put("leader", "controller", doc(id="ctl-b"))
    else:
        await store.delete("leader", "controller")
        if successor == "recreated":
            # The same holder's name on a new key: only the revision tells the terms apart.
            await store.create("leader", "controller", doc(id="ctl-a"))
    before = await snapshot(store, "leader", "workload")
    batch = [
        Update("workload", "exists", doc(v=2), expected_revision=None),
        Create("workload", "new", doc()),
        Require("leader", "controller", held),
    ]
    with pytest.raises(Fenced, match=f"'controller'.*not at revision {held}") as caught:
        await store.commit(batch)
    # A fenced writer is told it is no leader (UNAVAILABLE, NOT_LEADER), never a Conflict.
    assert isinstance(caught.value, NotLeader) and not isinstance(caught.value, Conflict)
    assert await snapshot(store, "leader", "workload") == before
    with pytest.raises(Fenced):
        await store.commit([Require("leader", "controller", held)])


async def test_a_failed_requirement_is_reported_before_other_failures(store: Store) -> None:
    held = await store.create("leader", "controller", doc())
    await store.create("workload", "a", doc())
    await store.put("leader", "controller", doc())
    # The Create alone would be AlreadyExists: a fenced writer must learn it is fenced instead
    # of reloading and retrying as it does after a lost compare.
    with pytest.raises(Fenced):
        await store.commit([Create("workload", "a", doc()), Require("leader", "controller", held)])


@pytest.mark.parametrize("revision", [0, -1, True, "3", None])
async def test_a_requirement_needs_a_positive_revision(store: Store, revision: object) -> None:
    r0 = await store.revision()
    with pytest.raises(Invalid, match="required revision"):
        await store.commit(
            [Create("workload", "a", doc()), Require("leader", "x", revision)]  # type: ignore[arg-type]
        )
    with pytest.raises(Invalid, match="more than once"):
        await store.commit([Put("leader", "x", doc()), Require("leader", "x", 1)])
    assert await store.revision() == r0
