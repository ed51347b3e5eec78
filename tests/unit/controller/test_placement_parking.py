"""An instance every node refused for reasons waiting cannot fix is not offered again on every
node event: only a change that could place it (a node joining, a node's drivers, labels or
capacity changing, the workload's spec changing) cuts its backoff short."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from orka import fit
from orka.api import agent_pb2 as apb
from orka.controller.placement import PlacementQueue
from orka.controller.repo import Change, Repo
from orka.models import Node, NodeState, Resources, Workload
from orka.rpc.place_reasons import place_result_to_pb
from orka.store.memory import MemoryStore
from tests.unit.controller.test_placement_queue import _RecordingLink, add, spec


@pytest.fixture
async def repo() -> AsyncIterator[Repo]:
    store = MemoryStore()
    await store.open()
    yield Repo(store)
    await store.close()


async def put_node(repo: Repo, name: str, **fields: object) -> None:
    def plan() -> list[Change]:
        old = repo.nodes.get(name)
        base = old if old is not None else Node(name=name, drivers=["process"])
        return [Change("nodes", name, base.model_copy(update=fields))]

    await repo.mutate(plan)


async def refused(
    repo: Repo, rejections: dict[fit.Reason, int]
) -> tuple[PlacementQueue, _RecordingLink, str]:
    """One instance, placed once and refused by every node for `rejections`."""
    [name] = await add(repo, spec("web"), 1)

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        return apb.PlaceResponse(
            results=[place_result_to_pb(a.instance, rejections=rejections) for a in items]
        )

    link = _RecordingLink(place=place)
    q = PlacementQueue(repo, link)  # type: ignore[arg-type]
    q.add(name)
    await q._place(q._take(time.monotonic()))
    assert len(link.placed) == 1
    assert repo.instances[name].reason == "Unschedulable"
    return q, link, name


def offered_now(q: PlacementQueue) -> list[str]:
    names = [i.name for i in q._take(time.monotonic())]
    for n in names:  # put back, as _place would after an answer
        q.inflight.discard(n)
        q.pending[n] = None
    return names


NO_CONTAINERD = {fit.no_driver("containerd"): 2}


async def test_node_events_that_cannot_help_do_not_re_offer_it(repo: Repo) -> None:
    await put_node(repo, "n0")
    await put_node(repo, "n1")
    q, _, name = await refused(repo, NO_CONTAINERD)
    assert name in q.parked
    assert repo.instances[name].message == "2 nodes: no containerd driver"
    # Heartbeat-level events: usage changes, a node goes NOT_READY and back, a cordon is lifted.
    await put_node(repo, "n0", usage=Resources(cpu_millis=300), state=NodeState.NOT_READY)
    q.cluster_changed()
    await put_node(repo, "n0", state=NodeState.READY, schedulable=False)
    q.cluster_changed()
    await put_node(repo, "n0", schedulable=True)
    q.cluster_changed()
    assert offered_now(q) == []
    assert name in q.parked and name in q.backoff


@pytest.mark.parametrize(
    "change",
    [
        {"node": "n2", "fields": {"drivers": ["containerd"]}},  # a node with the driver joins
        {"node": "n2", "fields": {}},  # any node joining may be the one
        {"node": "n1", "fields": {"drivers": ["process", "containerd"]}},
        {"node": "n1", "fields": {"labels": {"zone": "eu"}}},
        {"node": "n1", "fields": {"allocatable": Resources(cpu_millis=64000)}},
    ],
)
async def test_a_change_that_could_help_re_offers_it(repo: Repo, change: dict[str, object]) -> None:
    await put_node(repo, "n0")
    await put_node(repo, "n1")
    q, _, name = await refused(repo, NO_CONTAINERD)
    await put_node(repo, str(change["node"]), **change["fields"])  # type: ignore[arg-type]
    q.cluster_changed()
    assert offered_now(q) == [name]
    assert name not in q.parked


async def test_a_new_spec_re_offers_it(repo: Repo) -> None:
    await put_node(repo, "n0")
    q, _, name = await refused(repo, {fit.selector_mismatch("zone", "mars"): 1})
    assert offered_now(q) == []

    def plan() -> list[Change]:
        w = repo.workloads["web"]
        new = w.spec.model_copy(update={"node_selector": {}})
        return [Change("workloads", "web", Workload(spec=new))]

    await repo.mutate(plan)
    assert offered_now(q) == [name]


async def test_a_resolvable_refusal_is_re_offered_on_any_node_event(repo: Repo) -> None:
    await put_node(repo, "n0")
    await put_node(repo, "n1")
    # One node without the driver, one full: freed room on the full one would place it.
    q, _, name = await refused(repo, {fit.no_driver("containerd"): 1, fit.INSUFFICIENT_CPU: 1})
    assert name not in q.parked
    assert offered_now(q) == []  # backing off
    q.cluster_changed()
    assert offered_now(q) == [name]


async def test_a_refusal_that_raced_a_node_event_is_not_parked(repo: Repo) -> None:
    await put_node(repo, "n0")
    [name] = await add(repo, spec("web"), 1)

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        # A node joined while the batch was at the scheduler, which ranked without it.
        await put_node(repo, "n9", drivers=["containerd"])
        q.cluster_changed()
        return apb.PlaceResponse(
            results=[place_result_to_pb(a.instance, rejections=NO_CONTAINERD) for a in items]
        )

    q = PlacementQueue(repo, _RecordingLink(place=place))  # type: ignore[arg-type]
    q.add(name)
    await q._place(q._take(time.monotonic()))
    assert name not in q.parked
    q.cluster_changed()
    assert offered_now(q) == [name]
