"""How the placement queue cuts PENDING instances into Place batches."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from orka.api import agent_pb2 as apb
from orka.controller.placement import PlacementConfig, PlacementQueue, _Backoff, _spec_bytes
from orka.controller.repo import Change, Repo
from orka.models import (
    Instance,
    InstancePhase,
    Node,
    NodeState,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)
from orka.store.memory import MemoryStore


@pytest.fixture
async def repo() -> AsyncIterator[Repo]:
    store = MemoryStore()
    await store.open()
    yield Repo(store)
    await store.close()


def spec(name: str, env_bytes: int = 0) -> WorkloadSpec:
    env = {"PAD": "x" * env_bytes} if env_bytes else {}
    return WorkloadSpec(name=name, kind=WorkloadKind.PROCESS, command=["sleep", "1"], env=env)


async def add(repo: Repo, workload: WorkloadSpec, count: int, **kw: object) -> list[str]:
    names = [f"{workload.name}-{i:04d}" for i in range(count)]

    def plan() -> list[Change]:
        changes = [Change("workloads", workload.name, Workload(spec=workload))]
        changes += [
            Change("instances", n, Instance(name=n, workload=workload.name, **kw))  # type: ignore[arg-type]
            for n in names
        ]
        return changes

    await repo.mutate(plan)
    return names


def queue(repo: Repo, **config: int) -> PlacementQueue:
    return PlacementQueue(repo, link=None, config=PlacementConfig(**config))  # type: ignore[arg-type]


async def test_batches_take_at_most_batch_size_in_order(repo: Repo) -> None:
    names = await add(repo, spec("web"), 10)
    q = queue(repo, batch_size=4)
    for n in names:
        q.add(n)
    batches = [q._take(time.monotonic()) for _ in range(4)]
    assert [[i.name for i in b] for b in batches] == [names[0:4], names[4:8], names[8:10], []]
    assert q.inflight == set(names)
    assert not q.pending


async def test_large_specs_cut_a_batch_by_bytes_and_the_rest_waits(repo: Repo) -> None:
    big = spec("big", env_bytes=10_000)
    names = await add(repo, big, 10)
    per_instance = _spec_bytes(big) + len(names[0]) + 64
    q = queue(repo, batch_size=1000, batch_bytes=3 * per_instance + 10)
    for n in names:
        q.add(n)
    first = q._take(time.monotonic())
    assert [i.name for i in first] == names[:3]
    # Nothing is lost: the cut instances are still pending, in their order.
    assert list(q.pending) == names[3:]


async def test_an_instance_larger_than_the_byte_budget_still_goes_alone(repo: Repo) -> None:
    names = await add(repo, spec("huge", env_bytes=50_000), 2)
    q = queue(repo, batch_bytes=1000)
    for n in names:
        q.add(n)
    assert [i.name for i in q._take(time.monotonic())] == names[:1]
    assert [i.name for i in q._take(time.monotonic())] == names[1:]


async def test_take_drops_what_is_no_longer_pending_and_keeps_what_backs_off(repo: Repo) -> None:
    names = await add(repo, spec("web"), 3)
    bound = await add(repo, spec("db"), 1, phase=InstancePhase.SCHEDULED, node="n1")
    q = queue(repo)
    for n in [*names, *bound, "gone-0000"]:
        q.add(n)
    q.backoff[names[1]] = _Backoff(until=time.monotonic() + 60, delay=60)
    batch = q._take(time.monotonic())
    assert [i.name for i in batch] == [names[0], names[2]]
    # The one backing off waits its turn; the bound and the unknown ones are forgotten.
    assert list(q.pending) == [names[1]]


async def set_nodes(repo: Repo, ready: int, lost: int = 0) -> None:
    def plan() -> list[Change]:
        states = [NodeState.READY] * ready + [NodeState.LOST] * lost
        return [
            Change("nodes", f"n{i}", Node(name=f"n{i}", state=state))
            for i, state in enumerate(states)
        ]

    await repo.mutate(plan)


@pytest.mark.parametrize(
    ("ready", "lost", "limit"),
    [
        (0, 0, 100),  # no node known yet: the plain cap
        (10, 0, 100),  # 1000 / 10 = 100
        (40, 0, 25),
        (40, 500, 25),  # nodes that are not READY do not count
        (500, 0, 5),  # 1000 / 500 = 2, but never under min_batch_size
    ],
)
async def test_the_batch_shrinks_as_the_ready_nodes_grow(
    repo: Repo, ready: int, lost: int, limit: int
) -> None:
    await set_nodes(repo, ready, lost)
    q = queue(repo, batch_size=100, batch_node_product=1000, min_batch_size=5)
    assert q._batch_limit() == limit
    names = await add(repo, spec("web"), 150)
    for n in names:
        q.add(n)
    assert len(q._take(time.monotonic())) == limit


class _RecordingLink:
    """Stands in for the scheduler link: records the commands it is sent, answers nothing."""

    def __init__(self) -> None:
        self.commands: list[list[apb.NodeCommand]] = []

    async def command(self, cmds: list[apb.NodeCommand]) -> None:
        self.commands.append(list(cmds))


@pytest.mark.parametrize(
    "phase", [InstancePhase.SCHEDULED, InstancePhase.STARTING, InstancePhase.RUNNING]
)
async def test_bind_leaves_an_instance_bound_elsewhere_and_releases_the_offer(
    repo: Repo, phase: InstancePhase
) -> None:
    # A late Place answer for an instance that is no longer PENDING (bound by an earlier batch
    # or term) must not bind it a second time: the first node keeps it, the second's offer is
    # released so its reservation does not leak.
    [done] = await add(repo, spec("db"), 1, phase=phase, node="n1")
    [fresh] = await add(repo, spec("web"), 1)
    link = _RecordingLink()
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    committed = await q._bind({done: "n2", fresh: "n3"})
    assert [(i.name, i.node, i.phase) for i in committed] == [
        (fresh, "n3", InstancePhase.SCHEDULED)
    ]
    stored = repo.instances[done]
    assert (stored.phase, stored.node) == (phase, "n1")
    assert repo.instances[fresh].node == "n3"
    assert [
        [(c.node, c.WhichOneof("command"), c.release.instance) for c in b] for b in link.commands
    ] == [[("n2", "release", done)]]


async def test_bind_releases_offers_for_deleted_and_stopping_instances(repo: Repo) -> None:
    [stopping] = await add(repo, spec("web"), 1, desired_stop=True)
    link = _RecordingLink()
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    assert await q._bind({stopping: "n1", "gone-0000": "n2"}) == []
    assert repo.instances[stopping].phase is InstancePhase.PENDING
    assert repo.instances[stopping].node == ""
    assert [(c.node, c.release.instance) for c in link.commands[0]] == [
        ("n1", stopping),
        ("n2", "gone-0000"),
    ]
