"""List, then watch from the list's revision, under a stream of writes: the client rebuilds the
server's state with every change exactly once, also across a watcher cut off for falling
behind or a dropped stream, and a revision the server no longer holds is OUT_OF_RANGE.

The oracle for "nothing missed or repeated" is the controller's own history of changes
(every store write it made, in order): what the client received after the list's revision
must be exactly that sequence."""

from __future__ import annotations

import asyncio
import contextlib
import re

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.controller import events
from orka.rpc.pages import list_all
from tests.integration.cluster import Cluster, eventually, process_spec

Change = tuple[int, int, str, str]  # revision, event type, object kind, name


@pytest.fixture
def cluster_agents() -> int:
    return 2


def change_of(ev: pb.Event) -> Change:
    kind = ev.WhichOneof("object") or ""
    obj = getattr(ev, kind)
    return (ev.revision, ev.type, kind, obj.spec.name if kind == "workload" else obj.name)


def history_after(cluster: Cluster, revision: int) -> list[Change]:
    """Every change the controller made after `revision`, as a watcher should see it."""
    assert cluster.controller is not None
    hub = cluster.controller.events
    assert hub.floor <= revision, "the history no longer reaches back to the list"
    kinds = {"Workload": "workload", "Instance": "instance", "Node": "node"}
    out: list[Change] = []
    for e in hub.history:
        if e.revision > revision:
            kind = kinds[type(e.value).__name__]
            out.append((e.revision, e.type, kind, e.value.name))  # type: ignore[attr-defined]
    return out


class Mirror:
    """The client side: instances as listed, then as watched. An event applies only when it
    is newer than the copy held (the rule proto/controller.proto gives)."""

    def __init__(self, listed: list[pb.Instance]) -> None:
        self.held: dict[str, pb.Instance] = {i.name: i for i in listed}

    def apply(self, ev: pb.Event) -> None:
        if not ev.HasField("instance"):
            return
        have = self.held.get(ev.instance.name)
        if have is not None and have.revision >= ev.revision:
            return
        if ev.type == pb.Event.DELETED:
            self.held.pop(ev.instance.name, None)
        else:
            assert ev.instance.revision == ev.revision
            self.held[ev.instance.name] = ev.instance

    def state(self) -> dict[str, int]:
        return {name: i.revision for name, i in self.held.items()}


def server_state(cluster: Cluster) -> dict[str, int]:
    assert cluster.controller is not None
    repo = cluster.controller.repo
    return {name: repo.revision_of("instances", name) for name in repo.instances}


async def writes(cluster: Cluster, steps: int = 24) -> None:
    """Creates, scales and deletes, one step at a time, while the agents run what lands."""
    assert cluster.api is not None
    api = cluster.api
    for i in range(steps):
        await api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec(f"s{i:02d}", 6)))
        if i >= 3 and i % 3 == 0:
            await api.UpdateWorkload(
                pb.UpdateWorkloadRequest(spec=process_spec(f"s{i - 3:02d}", 9))
            )
        if i >= 4 and i % 4 == 0:
            await api.DeleteWorkload(pb.DeleteWorkloadRequest(name=f"s{i - 4:02d}"))
        await asyncio.sleep(0.03)


async def list_during_writes(cluster: Cluster) -> tuple[asyncio.Task[None], Mirror, int]:
    """Start the writes, then list instances in small pages while they go on."""
    assert cluster.api is not None
    writer = asyncio.create_task(writes(cluster))
    await eventually(lambda: _at_least(cluster, 10))
    listed, revision = await list_all(
        cluster.api.ListInstances, pb.ListInstancesRequest(page_size=3), "instances"
    )
    return writer, Mirror(listed), revision


async def _at_least(cluster: Cluster, count: int) -> bool:
    assert cluster.controller is not None
    return len(cluster.controller.repo.instances) >= count


async def settle(cluster: Cluster, mirror: Mirror, received: list[Change]) -> None:
    """Wait until the client holds what the server holds and has been sent every change."""
    assert cluster.controller is not None
    repo = cluster.controller.repo

    async def caught_up() -> bool:
        return mirror.state() == server_state(cluster) and (
            bool(received) and received[-1][0] == repo.revision
        )

    await eventually(caught_up, timeout=60)


async def read(
    stream: grpc.aio.UnaryStreamCall, mirror: Mirror, received: list[Change]
) -> grpc.aio.AioRpcError | None:
    """Apply events until the stream ends; its error, if it ends with one."""
    try:
        async for ev in stream:
            received.append(change_of(ev))
            mirror.apply(ev)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.CANCELLED:
            return None
        return err
    return None


async def stop(reader: asyncio.Task[object], stream: grpc.aio.UnaryStreamCall) -> None:
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    stream.cancel()


def check_sequence(received: list[Change], since: int) -> None:
    revisions = [c[0] for c in received]
    assert revisions == sorted(revisions) and revisions[0] > since
    assert len(set(received)) == len(received), "an event came twice"


async def test_list_then_watch_from_the_list_revision_sees_every_change_once(
    cluster: Cluster,
) -> None:
    assert cluster.api is not None
    writer, mirror, revision = await list_during_writes(cluster)
    received: list[Change] = []
    stream = cluster.api.WatchEvents(pb.WatchEventsRequest(since_revision=revision))
    reader = asyncio.create_task(read(stream, mirror, received))
    await writer
    await settle(cluster, mirror, received)
    await stop(reader, stream)
    check_sequence(received, revision)
    assert received == history_after(cluster, revision)


async def test_a_watcher_cut_off_for_falling_behind_resumes_where_it_was_cut(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cluster.api is not None and cluster.controller is not None
    writer, mirror, revision = await list_during_writes(cluster)
    received: list[Change] = []
    monkeypatch.setattr(events, "MAX_BACKLOG", 40)
    stream = cluster.api.WatchEvents(pb.WatchEventsRequest(since_revision=revision))
    # Not read until the controller has cut it off: big events (a 60 kB spec changed again
    # and again) fill the transport's buffers until events queue up, then one commit of 100
    # new instances passes the bound in the middle of its revision.
    subs = cluster.controller.events.subscribers
    await eventually(lambda: _true(len(subs) == 1))
    [sub] = subs
    api = cluster.api
    for n in range(400):
        if sub.queue.qsize() >= 5:
            break
        big = process_spec("big", 0, env={"PAD": f"{n:04d}" + "x" * 60_000})
        if n == 0:
            await api.CreateWorkload(pb.CreateWorkloadRequest(spec=big))
        else:
            await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=big))
    assert sub.queue.qsize() >= 5 and subs
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec("many", 100)))
    await eventually(lambda: _true(not subs))
    err = await read(stream, mirror, received)
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    match = re.search(r"since_revision=(\d+)", err.details() or "")
    assert match is not None
    last = int(match.group(1))
    # Everything up to the revision named, nothing after it.
    assert received and received[-1][0] == last
    assert received == history_after(cluster, revision)[: len(received)]

    monkeypatch.setattr(events, "MAX_BACKLOG", 100_000)
    resumed = cluster.api.WatchEvents(pb.WatchEventsRequest(since_revision=last))
    reader = asyncio.create_task(read(resumed, mirror, received))
    await writer
    await settle(cluster, mirror, received)
    await stop(reader, resumed)
    check_sequence(received, revision)
    assert received == history_after(cluster, revision)


async def test_a_dropped_stream_resumes_from_the_revision_before_the_last_received(
    cluster: Cluster,
) -> None:
    """A stream may end inside one commit's events; resuming from the revision before the
    last one received repeats only events of that revision, and the client's rule (newer
    than what it holds) applies each change once."""
    assert cluster.api is not None
    writer, mirror, revision = await list_during_writes(cluster)
    received: list[Change] = []
    stream = cluster.api.WatchEvents(pb.WatchEventsRequest(since_revision=revision))
    # Drop the stream right after an instance is added: that commit added several.
    async for ev in stream:
        received.append(change_of(ev))
        mirror.apply(ev)
        if ev.type == pb.Event.ADDED and ev.HasField("instance") and len(received) > 5:
            break
    stream.cancel()
    last = received[-1][0]
    second: list[Change] = []
    resumed = cluster.api.WatchEvents(pb.WatchEventsRequest(since_revision=last - 1))
    reader = asyncio.create_task(read(resumed, mirror, second))
    await writer
    await settle(cluster, mirror, second)
    await stop(reader, resumed)
    repeated = [c for c in second if c in set(received)]
    assert repeated and all(c[0] == last for c in repeated)
    combined = received + [c for c in second if c not in set(received)]
    check_sequence(combined, revision)
    assert combined == history_after(cluster, revision)


async def test_a_revision_older_than_the_history_is_out_of_range(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cluster.api is not None and cluster.controller is not None
    api, hub, repo = cluster.api, cluster.controller.events, cluster.controller.repo
    monkeypatch.setattr(events, "MAX_HISTORY", 10)
    start = repo.revision
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=process_spec("web", 20)))
    # Quiet again (all running), so the history stays as it is below.
    await eventually(lambda: _all_running(cluster, "web", 20), timeout=30)
    assert hub.floor > start

    async def first_error(since: int) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(10):
                async for _ in api.WatchEvents(pb.WatchEventsRequest(since_revision=since)):
                    pass
        return info.value

    err = await first_error(start)
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE
    assert f"since_revision: {start} is older than the oldest change" in (err.details() or "")
    assert "list again" in (err.details() or "")
    for ahead in (repo.revision + 1000, -1):
        err = await first_error(ahead)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.details() or "").startswith("since_revision: ")
    # The oldest revision still held resumes: the retained changes after it come first.
    # (The entries at the floor revision itself are not after it.)
    since = max(e.revision for e in hub.history) - 1
    expected = history_after(cluster, since)
    assert expected and hub.floor <= since
    got: list[Change] = []
    async with asyncio.timeout(10):
        async for ev in api.WatchEvents(pb.WatchEventsRequest(since_revision=since)):
            got.append(change_of(ev))
            if len(got) == len(expected):
                break
    assert got == expected


async def _all_running(cluster: Cluster, workload: str, count: int) -> bool:
    return len(await cluster.running(workload)) == count


async def _true(value: bool) -> bool:
    return value
