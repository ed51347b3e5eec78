"""How the placement queue cuts PENDING instances into Place batches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest
import structlog
from google.rpc import code_pb2

from orka import fit
from orka.api import agent_pb2 as apb
from orka.controller import commands
from orka.controller.commands import Assignment, NodeCommand, stop_command
from orka.controller.link import (
    CommandResult,
    PlaceResult,
    _spec_bytes,
    assignment_to_pb,
    command_result_from_pb,
    command_to_pb,
    place_result_from_pb,
)
from orka.controller.placement import PlacementConfig, PlacementQueue, _Backoff
from orka.controller.repo import Change, Repo
from orka.errors import Unavailable
from orka.models import (
    Instance,
    InstancePhase,
    Node,
    NodeState,
    Volume,
    VolumeMount,
    VolumeSpec,
    VolumeState,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc import convert
from orka.rpc.place_reasons import place_result_to_pb
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


def queue(repo: Repo, **config: float) -> PlacementQueue:
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


@pytest.mark.parametrize("ready", [0, 10, 5000])
async def test_a_batch_takes_batch_size_whatever_the_cluster_size(repo: Repo, ready: int) -> None:
    # No bound by nodes: the scheduler's retries rank a few nodes each, not the cluster.
    await set_nodes(repo, ready)
    q = queue(repo, batch_size=100)
    names = await add(repo, spec("web"), 150)
    for n in names:
        q.add(n)
    assert [i.name for i in q._take(time.monotonic())] == names[:100]


class _RecordingLink:
    """Stands in for the scheduler link: records what it is sent and answers with `place` and
    `command` when given (each takes the request and returns the response or raises); a start
    is answered ok by default."""

    def __init__(
        self,
        place: Callable[[list[apb.Assignment]], Awaitable[apb.PlaceResponse]] | None = None,
        command: Callable[[list[apb.NodeCommand]], Awaitable[apb.CommandResponse]] | None = None,
    ) -> None:
        self.placed: list[list[apb.Assignment]] = []
        self.commands: list[list[apb.NodeCommand]] = []
        self._place = place
        self._command = command

    # Both speak the wire format through the link's converters, as SchedulerLink does.
    async def place(self, items: Sequence[Assignment]) -> list[PlaceResult]:
        msgs = [assignment_to_pb(a) for a in items]
        self.placed.append(msgs)
        assert self._place is not None
        return [place_result_from_pb(r) for r in (await self._place(msgs)).results]

    async def command(self, cmds: Sequence[NodeCommand]) -> list[CommandResult]:
        msgs = [command_to_pb(c) for c in cmds]
        self.commands.append(msgs)
        if self._command is None:
            ok = apb.CommandResult(status=convert.ok_status())
            return [command_result_from_pb(ok) for _ in cmds]
        return [command_result_from_pb(r) for r in (await self._command(msgs)).results]


def assignment(inst: Instance, w: Workload) -> apb.Assignment:
    """The assignment sent for `inst`, as on the wire."""
    return assignment_to_pb(Assignment.of(inst, w))


def start_command(inst: Instance, w: Workload) -> apb.NodeCommand:
    """The start sent for `inst`, as on the wire."""
    return command_to_pb(commands.start_command(inst, w))


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


PENDING, SCHEDULED, RUNNING = InstancePhase.PENDING, InstancePhase.SCHEDULED, InstancePhase.RUNNING


async def put(repo: Repo, *items: Workload | Instance) -> None:
    def plan() -> list[Change]:
        return [
            Change("workloads", i.spec.name, i)
            if isinstance(i, Workload)
            else Change("instances", i.name, i)
            for i in items
        ]

    await repo.mutate(plan)


async def until(check: Callable[[], object], *tasks: asyncio.Task[None]) -> None:
    """Wait for `check` (10 s at most); a task of `tasks` that crashed raises its error."""
    deadline = time.monotonic() + 10
    while not check():
        for task in tasks:
            if task.done():
                task.result()
        assert time.monotonic() < deadline, "condition not met within 10 s"
        await asyncio.sleep(0.001)


def test_assignment_and_start_command_carry_instance_generation_spec_and_node() -> None:
    w = Workload(spec=spec("web"))
    inst = Instance(name="web-0000", workload="web", generation=3, node="n1")
    want = apb.Assignment(instance="web-0000", generation=3, spec=convert.spec_to_pb(w.spec))
    assert assignment(inst, w) == want
    assert start_command(inst, w) == apb.NodeCommand(
        node="n1", start=apb.StartInstance(assignment=want)
    )


def test_stop_command_stops_and_removes_with_the_reason() -> None:
    assert command_to_pb(stop_command("n1", "web-0000", "scaled down")) == apb.NodeCommand(
        node="n1", stop=apb.StopInstance(instance="web-0000", remove=True, reason="scaled down")
    )


async def test_add_ignores_what_is_pending_or_in_flight_and_busy_means_in_flight(
    repo: Repo,
) -> None:
    names = await add(repo, spec("web"), 3)
    q = queue(repo, batch_size=1)
    q.add(names[0])
    assert [i.name for i in q._take(time.monotonic())] == names[:1]
    for n in [names[1], names[2], names[1], names[0]]:
        q.add(n)
    # The one in flight is not queued a second time (it would be placed twice).
    assert list(q.pending) == names[1:]
    assert [q.busy(n) for n in names] == [True, False, False]


@pytest.mark.parametrize(("spare", "taken"), [(0, 3), (-1, 2)])
async def test_the_byte_budget_is_exact_and_a_full_batch_stops_the_scan(
    repo: Repo, spare: int, taken: int
) -> None:
    s = spec("web")
    names = await add(repo, s, 5)
    per_instance = _spec_bytes(s) + len(names[0]) + 64
    q = queue(repo, batch_bytes=3 * per_instance + spare)
    order = [*names[:3], "gone-0000", *names[3:]]
    for n in order:
        q.add(n)
    assert [i.name for i in q._take(time.monotonic())] == names[:taken]
    # What comes after the cut is left for the next batch as it is, even an entry now gone.
    assert list(q.pending) == order[taken:]


async def test_take_drops_stopping_and_orphaned_instances_and_takes_a_backoff_due_now(
    repo: Repo,
) -> None:
    [stopping] = await add(repo, spec("db"), 1, desired_stop=True)
    [due] = await add(repo, spec("web"), 1)
    await put(repo, Instance(name="orphan-0000", workload="gone"))
    q = queue(repo)
    for n in [stopping, "orphan-0000", due]:
        q.add(n)
    now = time.monotonic()
    q.backoff[due] = _Backoff(until=now, delay=1.0)
    assert [i.name for i in q._take(now)] == [due]
    assert not q.pending
    assert q.inflight == {due}


async def test_retry_later_doubles_from_backoff_start_up_to_backoff_max(repo: Repo) -> None:
    q = queue(repo, backoff_start=1.0, backoff_max=30.0)
    delays = []
    for _ in range(7):
        before = time.monotonic()
        q._retry_later("web-0000")
        after = time.monotonic()
        b = q.backoff["web-0000"]
        assert before + b.delay <= b.until <= after + b.delay
        delays.append(b.delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert list(q.backoff) == ["web-0000"]
    assert list(q.pending) == ["web-0000"]


async def test_bind_writes_the_binding_and_clears_the_backoff(repo: Repo) -> None:
    names = await add(
        repo, spec("web"), 2, reason="Unschedulable", message="1 node: cordoned", updated_at=1.0
    )
    link = _RecordingLink()
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    q.backoff[names[0]] = _Backoff(until=time.monotonic() + 60, delay=60)
    before = time.time()
    committed = await q._bind({names[0]: "n1", names[1]: "n2"})
    after = time.time()
    assert committed == [repo.instances[n] for n in names]
    for name, node in zip(names, ["n1", "n2"], strict=True):
        i = repo.instances[name]
        assert (i.phase, i.node, i.reason, i.message) == (SCHEDULED, node, "Scheduled", "")
        assert i.updated_at is not None and before <= i.updated_at <= after
        assert i.scheduled_at == i.updated_at
    assert q.backoff == {}
    assert link.commands == []  # nothing to release


async def test_bind_keeps_its_bindings_when_a_release_fails_and_logs_it(repo: Repo) -> None:
    [fresh] = await add(repo, spec("web"), 1)

    async def command(cmds: list[apb.NodeCommand]) -> apb.CommandResponse:
        raise Unavailable("scheduler gone")

    link = _RecordingLink(command=command)
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        committed = await q._bind({fresh: "n1", "gone-0000": "n2"})
    assert [(i.name, i.node) for i in committed] == [(fresh, "n1")]
    assert repo.instances[fresh].node == "n1"
    assert link.commands == [
        [apb.NodeCommand(node="n2", release=apb.ReleaseOffer(instance="gone-0000"))]
    ]
    assert logs == [{"event": "release failed", "error": "scheduler gone", "log_level": "warning"}]


def _scheduled(count: int) -> list[Instance]:
    return [
        Instance(name=f"web-{i}", workload="web", phase=SCHEDULED, node=f"n{i}", updated_at=1.0)
        for i in range(count)
    ]


async def test_start_unbinds_only_what_a_node_refused(repo: Repo) -> None:
    w = Workload(spec=spec("web"))
    insts = _scheduled(3)
    # Its workload was deleted between the bind and the start: nothing to start.
    orphan = Instance(name="orphan-0", workload="gone", phase=SCHEDULED, node="n9")
    await put(repo, w, orphan, *insts)

    async def command(cmds: list[apb.NodeCommand]) -> apb.CommandResponse:
        return apb.CommandResponse(
            results=[
                apb.CommandResult(status=convert.ok_status()),
                apb.CommandResult(
                    status=convert.error_status(code_pb2.FAILED_PRECONDITION, "image missing")
                ),
                apb.CommandResult(
                    status=convert.error_status(code_pb2.UNAVAILABLE, "no answer"), unconfirmed=True
                ),
            ]
        )

    link = _RecordingLink(command=command)
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    before = time.time()
    await q._start([orphan, *insts])
    after = time.time()
    assert link.commands == [[start_command(i, w) for i in insts]]
    started, refused, unconfirmed = (repo.instances[i.name] for i in insts)
    # Started, or maybe started (no answer): both stay bound to their node.
    assert (started, unconfirmed) == (insts[0], insts[2])
    assert repo.instances["orphan-0"] == orphan
    assert (refused.phase, refused.node, refused.reason, refused.message) == (
        PENDING,
        "",
        "StartRefused",
        "node n1: image missing",
    )
    assert before <= refused.updated_at <= after
    assert list(q.pending) == ["web-1"]
    assert list(q.backoff) == ["web-1"]


async def test_unbind_leaves_what_is_no_longer_scheduled(repo: Repo) -> None:
    running = Instance(name="web-0", workload="web", phase=RUNNING, node="n1")
    [scheduled] = _scheduled(2)[1:]
    await put(repo, Workload(spec=spec("web")), running, scheduled)
    q = queue(repo)
    await q._unbind({"gone-0": "refused", "web-0": "refused", "web-1": "disk full"})
    assert repo.instances["web-0"] == running
    unbound = repo.instances["web-1"]
    assert (unbound.phase, unbound.node, unbound.reason, unbound.message) == (
        PENDING,
        "",
        "StartRefused",
        "node n1: disk full",
    )
    # All three wait their backoff; _take forgets the two that are not PENDING.
    assert list(q.pending) == ["gone-0", "web-0", "web-1"]
    assert list(q.backoff) == ["gone-0", "web-0", "web-1"]


async def test_start_of_nothing_sends_nothing(repo: Repo) -> None:
    link = _RecordingLink()
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    await q._start([])
    assert link.commands == []


async def test_a_start_the_scheduler_did_not_confirm_stays_bound_and_is_logged(
    repo: Repo,
) -> None:
    insts = _scheduled(2)
    await put(repo, Workload(spec=spec("web")), *insts)

    async def command(cmds: list[apb.NodeCommand]) -> apb.CommandResponse:
        raise Unavailable("no scheduler")

    q = PlacementQueue(repo, link=_RecordingLink(command=command))  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        await q._start(insts)
    assert [repo.instances[i.name] for i in insts] == insts
    assert not q.pending
    assert logs == [
        {
            "event": "start not confirmed; will retry",
            "count": 2,
            "error": "no scheduler",
            "log_level": "warning",
        }
    ]


async def test_a_short_answer_to_the_starts_fails_the_batch(repo: Repo) -> None:
    insts = _scheduled(2)
    await put(repo, Workload(spec=spec("web")), *insts)

    async def command(cmds: list[apb.NodeCommand]) -> apb.CommandResponse:
        return apb.CommandResponse(
            results=[
                apb.CommandResult(
                    status=convert.error_status(code_pb2.FAILED_PRECONDITION, "image missing")
                )
            ]
        )

    q = PlacementQueue(repo, link=_RecordingLink(command=command))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^zip\(\) argument 2 is shorter than argument 1$"):
        await q._start(insts)


async def test_mark_unplaced_writes_only_what_changed_and_retries_what_exists(
    repo: Repo,
) -> None:
    def inst(name: str, **kw: object) -> Instance:
        return Instance(name=name, workload="web", updated_at=1.0, **kw)  # type: ignore[arg-type]

    bound = inst("bound", phase=SCHEDULED, node="n1", reason="Scheduled")
    same = inst("same", reason="Unschedulable", message="m1")
    new_message = inst("new-message", reason="Unschedulable", message="old")
    other_reason = inst("other-reason", reason="StartRefused", message="m1")
    fresh = inst("fresh")
    await put(repo, Workload(spec=spec("web")), bound, same, new_message, other_reason, fresh)
    q = queue(repo)
    before = time.time()
    await q._mark_unplaced(
        {
            "gone": "m1",
            "bound": "m1",
            "same": "m1",
            "new-message": "m2",
            "other-reason": "m1",
            "fresh": "m3",
        }
    )
    after = time.time()
    assert (repo.instances["bound"], repo.instances["same"]) == (bound, same)
    for name, message in [("new-message", "m2"), ("other-reason", "m1"), ("fresh", "m3")]:
        i = repo.instances[name]
        assert (i.phase, i.reason, i.message) == (PENDING, "Unschedulable", message)
        assert before <= i.updated_at <= after
    retried = ["bound", "same", "new-message", "other-reason", "fresh"]
    assert list(q.pending) == retried
    assert list(q.backoff) == retried


async def test_place_binds_what_was_placed_marks_the_rest_and_starts_the_bound(
    repo: Repo,
) -> None:
    names = await add(repo, spec("web"), 3, generation=2)

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        return apb.PlaceResponse(
            results=[
                apb.PlaceResult(instance=names[0], node="n1"),
                place_result_to_pb(names[1], rejections={fit.INSUFFICIENT_MEMORY: 2}),
                apb.PlaceResult(instance=names[2], node="n2"),
            ]
        )

    link = _RecordingLink(place=place)
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    for n in names:
        q.add(n)
    batch = q._take(time.monotonic())
    await q._place(batch)
    w = repo.workloads["web"]
    assert link.placed == [[assignment(i, w) for i in batch]]
    a, b, c = (repo.instances[n] for n in names)
    assert [(i.phase, i.node, i.reason, i.message) for i in (a, b, c)] == [
        (SCHEDULED, "n1", "Scheduled", ""),
        (PENDING, "", "Unschedulable", "2 nodes: insufficient memory"),
        (SCHEDULED, "n2", "Scheduled", ""),
    ]
    assert link.commands == [[start_command(a, w), start_command(c, w)]]
    assert q.inflight == set()
    assert list(q.pending) == names[1:2]
    assert list(q.backoff) == names[1:2]


async def test_place_when_the_scheduler_is_unavailable_marks_the_batch_for_later(
    repo: Repo,
) -> None:
    names = await add(repo, spec("web"), 2)

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        raise Unavailable("no scheduler connected")

    link = _RecordingLink(place=place)
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    for n in names:
        q.add(n)
    await q._place(q._take(time.monotonic()))
    assert [(repo.instances[n].phase, repo.instances[n].message) for n in names] == [
        (PENDING, "scheduler unavailable: no scheduler connected")
    ] * 2
    assert [repo.instances[n].reason for n in names] == ["Unschedulable"] * 2
    assert link.commands == []
    assert q.inflight == set()
    assert list(q.pending) == names
    assert list(q.backoff) == names


async def test_run_retries_an_unplaced_instance_on_one_timer_when_its_backoff_is_due(
    repo: Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    [name] = await add(repo, spec("web"), 1)
    answers = [
        place_result_to_pb(name, rejections={fit.CORDONED: 1}),
        apb.PlaceResult(instance=name, node="n1"),
    ]

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        return apb.PlaceResponse(results=[answers.pop(0)])

    link = _RecordingLink(place=place)
    q = PlacementQueue(repo, link, PlacementConfig(backoff_start=0.05))  # type: ignore[arg-type]
    # Every timer the queue sets for itself: when it fires, when it was set, and when the
    # backoff it waits for is due.
    timers: list[tuple[float, float, float | None]] = []
    loop = asyncio.get_running_loop()
    call_later = loop.call_later

    def spy(delay: float, callback: Callable[..., object], *args: object) -> asyncio.TimerHandle:
        if callback == q._wake.set:
            b = q.backoff.get(name)
            now = time.monotonic()
            timers.append((now + delay, now, None if b is None else b.until))
        return call_later(delay, callback, *args)

    monkeypatch.setattr(loop, "call_later", spy)
    task = asyncio.create_task(q.run())
    try:
        q.add(name)
        await until(lambda: link.commands, task)
    finally:
        task.cancel()
        await q.close()
    assert link.placed == [[assignment(repo.instances[name], repo.workloads["web"])]] * 2
    assert (repo.instances[name].phase, repo.instances[name].node) == (SCHEDULED, "n1")
    assert timers
    for fires, set_at, due in timers:
        assert due is not None
        # Never before the backoff is due (a wake-up that finds nothing to do would spin),
        # and not much after it.
        assert due + 0.01 - 1e-6 <= fires <= max(due, set_at) + 0.01 + 0.2


async def test_run_keeps_at_most_max_batches_in_flight_and_places_them_all(repo: Repo) -> None:
    names = await add(repo, spec("web"), 5)
    gate = asyncio.Event()

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        await gate.wait()
        return apb.PlaceResponse(
            results=[apb.PlaceResult(instance=a.instance, node="n1") for a in items]
        )

    link = _RecordingLink(place=place)
    config = PlacementConfig(batch_size=1, max_batches_in_flight=2)
    q = PlacementQueue(repo, link, config)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(q.run())
        try:
            for n in names:
                q.add(n)
            await until(lambda: len(link.placed) >= 2, task)
            for _ in range(20):
                await asyncio.sleep(0)  # give a third batch every chance to start
            assert [[a.instance for a in b] for b in link.placed] == [names[:1], names[1:2]]
            assert len(q._batches) == 2
            assert list(q.pending) == names[2:]
            gate.set()
            await until(
                lambda: all(repo.instances[n].phase is SCHEDULED for n in names) and not q._batches,
                task,
            )
        finally:
            task.cancel()
            await q.close()
    assert logs == []  # a batch that ends well logs nothing
    assert [[a.instance for a in b] for b in link.placed] == [[n] for n in names]
    assert q.inflight == set()


async def test_a_batch_that_fails_is_logged_with_its_error(repo: Repo) -> None:
    [name] = await add(repo, spec("web"), 1)

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        raise RuntimeError("boom")

    link = _RecordingLink(place=place)
    q = PlacementQueue(repo, link)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(q.run())
        try:
            q.add(name)
            await until(lambda: link.placed and not q._batches, task)
        finally:
            task.cancel()
    assert logs == [
        {"event": "placement batch failed", "error": "RuntimeError('boom')", "log_level": "error"}
    ]
    assert q.inflight == set()


async def test_close_cancels_the_batches_in_flight_and_swallows_how_they_end(
    repo: Repo,
) -> None:
    names = await add(repo, spec("web"), 2)
    started: list[str] = []

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        started.append(items[0].instance)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if items[0].instance == names[1]:
                raise RuntimeError("link closed") from None
            raise
        raise AssertionError("never woken")

    link = _RecordingLink(place=place)
    config = PlacementConfig(batch_size=1, max_batches_in_flight=2)
    q = PlacementQueue(repo, link, config)  # type: ignore[arg-type]
    task = asyncio.create_task(q.run())
    for n in names:
        q.add(n)
    try:
        await until(lambda: len(started) == 2, task)
    finally:
        task.cancel()
    batches = list(q._batches)
    with structlog.testing.capture_logs():
        await q.close()
    assert all(t.done() for t in batches)
    ended = sorted("cancelled" if t.cancelled() else repr(t.exception()) for t in batches)
    assert ended == ["RuntimeError('link closed')", "cancelled"]
    assert q.inflight == set()


async def test_place_records_the_chosen_node_the_passed_over_and_folds_failures(
    repo: Repo,
) -> None:
    names = await add(repo, spec("web"), 2)
    cordoned = fit.CORDONED

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        return apb.PlaceResponse(
            results=[
                place_result_to_pb(
                    names[0],
                    "n2",
                    refusals={"n1": fit.refused("image missing")},
                    passed_over={cordoned: 3},
                ),
                place_result_to_pb(names[1], rejections={fit.INSUFFICIENT_MEMORY: 2}),
            ]
        )

    q = PlacementQueue(repo, link=_RecordingLink(place=place))  # type: ignore[arg-type]
    for _ in range(2):
        for n in names:
            q.pending.pop(n, None)
            q.add(n)
        await q._place(q._take(time.monotonic() + 100))
    (placed,) = q.activity.entries("instance", names[0])
    assert (placed.type, placed.reason) == ("Normal", "Scheduled")
    assert placed.message == (
        "placed on n2; 3 nodes passed over: 3 nodes: cordoned;"
        " refused the offer: n1: refused: image missing"
    )
    (failed,) = q.activity.entries("instance", names[1])
    assert (failed.type, failed.reason, failed.count) == ("Warning", "FailedScheduling", 2)
    assert failed.message == "no node took it: 2 nodes: insufficient memory"


async def test_one_unbound_volume_is_placed_with_one_instance_and_the_next_follows_it(
    repo: Repo,
) -> None:
    """Two replicas name one unbound volume: only the first is offered; the volume is bound
    with it, in the same write; the second, held back, then goes with the volume's node."""
    s = spec("web").model_copy(update={"volumes": [VolumeMount(volume="data-1")]})
    names = await add(repo, s, 2)
    vol = Volume(spec=VolumeSpec(name="data-1", size_bytes=1 << 20))
    await repo.mutate(lambda: [Change("volumes", "data-1", vol, create=True)])
    repo.nodes["n2"] = Node(name="n2", pool="p2")

    async def place(items: list[apb.Assignment]) -> apb.PlaceResponse:
        return apb.PlaceResponse(
            results=[apb.PlaceResult(instance=i.instance, node="n2") for i in items]
        )

    link = _RecordingLink(place=place)
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    for n in names:
        q.add(n)
    await q._place(q._take(time.monotonic()))
    [[offered]] = link.placed
    assert (offered.instance, [(v.name, v.node) for v in offered.volumes]) == (
        names[0],
        [("data-1", "")],
    )
    bound = repo.volumes["data-1"]
    assert (bound.node, bound.pool, bound.backend, bound.state) == (
        "n2",
        "p2",
        "ext4",
        VolumeState.PENDING,
    )
    assert repo.instances[names[0]].node == "n2"
    # The start carries the volume with its node.
    [[start]] = link.commands
    assert [(v.name, v.node) for v in start.start.assignment.volumes] == [("data-1", "n2")]
    # The second was held back (not offered, not marked) and is due again: the volume changed.
    assert repo.instances[names[1]].phase is PENDING and repo.instances[names[1]].reason == ""
    assert q.placing == {}
    await q._place(q._take(time.monotonic()))
    assert [(v.name, v.node) for v in link.placed[1][0].volumes] == [("data-1", "n2")]


async def test_an_instance_whose_volume_is_missing_waits_with_the_reason_and_is_not_offered(
    repo: Repo,
) -> None:
    s = spec("web").model_copy(update={"volumes": [VolumeMount(volume="data-1")]})
    [name] = await add(repo, s, 1)
    link = _RecordingLink()
    q = PlacementQueue(repo, link=link)  # type: ignore[arg-type]
    q.add(name)
    await q._place(q._take(time.monotonic()))
    assert link.placed == []
    i = repo.instances[name]
    assert (i.phase, i.reason, i.message) == (
        PENDING,
        "VolumeUnavailable",
        "volume data-1 does not exist",
    )
    assert name in q.backoff and q.waiting_on == {"data-1": {name}}
