"""The public API's calls as a client sees them, against a real controller: the exact answer
and error of each call (names checked, records found or not), the quota bounds to the unit,
the nodes' flags as stored and as sent to the scheduler, and how watch events are batched."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.controller.api import MAX_BATCH_BYTES, MAX_EVENT_BATCH, ControllerApi, Quotas
from orka.controller.repo import Change
from orka.errors import Invalid, ResourceExhausted, from_rpc_error
from orka.models import Workload, WorkloadSpec
from orka.rpc import convert
from tests.integration.cluster import Cluster, eventually
from tests.integration.cluster import process_spec as spec

BAD_NAME = (
    "{field} 'Bad_Name' must be 1-63 lowercase letters, digits or '-',"
    " starting and ending with a letter or digit"
)


def parts(cluster: Cluster) -> tuple[pb_grpc.ControllerStub, ControllerApi]:
    assert cluster.api is not None and cluster.controller is not None
    return cluster.api, cluster.controller.api


async def error(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code(), info.value.details() or ""


async def create(cluster: Cluster, s: pb.WorkloadSpec) -> pb.Workload:
    api, _ = parts(cluster)
    return await api.CreateWorkload(pb.CreateWorkloadRequest(spec=s))


def record_writes(servicer: ControllerApi, handler: str) -> list[list[Change]]:
    """The changes each call of `handler` wrote (its plan's result), in order."""
    writes: list[list[Change]] = []
    mutate = servicer.repo.mutate

    async def recording(plan: Callable[[], list[Change]]) -> list[Change]:
        changes = await mutate(plan)
        if handler in plan.__qualname__:
            writes.append(changes)
        return changes

    servicer.repo.mutate = recording  # type: ignore[method-assign]
    return writes


def stored_size(servicer: ControllerApi, name: str) -> int:
    return convert.spec_to_pb(servicer.repo.workloads[name].spec).ByteSize()


# ---- quotas ----


@pytest.mark.parametrize("name", ["max_workloads", "max_instances", "max_spec_bytes"])
def test_each_quota_must_be_positive_and_one_is_enough(name: str) -> None:
    for bad in (0, -1):
        with pytest.raises(Invalid) as info:
            Quotas(**{name: bad})  # type: ignore[arg-type]
        assert str(info.value) == f"--{name.replace('_', '-')}: must be > 0"
    assert getattr(Quotas(**{name: 1}), name) == 1  # type: ignore[arg-type]


async def test_the_controllers_configured_quotas_are_the_apis(
    certs_dir: Path, tmp_path: Path
) -> None:
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.scheduler.start()
        await c.start_controller(quotas=Quotas(max_workloads=1))
        await create(c, spec("a"))
        assert await error(create(c, spec("b"))) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "quota max_workloads: the cluster already holds 1 workloads, its limit is 1",
        )
    finally:
        await c.stop()


async def test_max_workloads_counts_to_the_limit_with_an_exact_message(cluster: Cluster) -> None:
    _, servicer = parts(cluster)
    servicer.quotas = Quotas(max_workloads=2)
    await create(cluster, spec("a"))
    await create(cluster, spec("b"))  # the limit itself is allowed
    assert await error(create(cluster, spec("c"))) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "quota max_workloads: the cluster already holds 2 workloads, its limit is 2",
    )


async def test_max_instances_counts_to_the_limit_with_an_exact_message(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    servicer.quotas = Quotas(max_instances=3)
    await create(cluster, spec("a", replicas=1))
    assert await error(create(cluster, spec("b", replicas=3))) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "quota max_instances: 4 replicas over all workloads would exceed the cluster's limit of 3",
    )
    await create(cluster, spec("b", replicas=2))  # 3: the limit itself is allowed
    # Scaling counts the workload's new replicas instead of its old ones, not on top of them.
    await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("b", replicas=1)))
    await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("b", replicas=2)))
    assert await error(
        api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("b", replicas=3)))
    ) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "quota max_instances: 4 replicas over all workloads would exceed the cluster's limit of 3",
    )


async def test_a_cluster_over_a_lowered_instance_quota_may_change_without_scaling_up(
    cluster: Cluster,
) -> None:
    api, servicer = parts(cluster)
    await create(cluster, spec("a", replicas=2))
    servicer.quotas = Quotas(max_instances=1)
    got = await api.UpdateWorkload(
        pb.UpdateWorkloadRequest(spec=spec("a", replicas=2, command=["sleep", "200"]))
    )
    assert (list(got.spec.command), got.spec.replicas) == (["sleep", "200"], 2)
    got = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("a", replicas=1)))
    assert got.spec.replicas == 1


async def test_max_spec_bytes_counts_to_the_limit_with_an_exact_message(cluster: Cluster) -> None:
    _, servicer = parts(cluster)
    await create(cluster, spec("a", env={"K": "v" * 1000}))
    a = stored_size(servicer, "a")
    b = spec("b", env={"K": "w" * 2000})
    size = b.ByteSize()
    servicer.quotas = Quotas(max_spec_bytes=a + size - 1)
    assert await error(create(cluster, b)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"quota max_spec_bytes: the workloads' specs would take {a + size} bytes, over the"
        f" cluster's limit of {a + size - 1} (this spec: {size} bytes)",
    )
    servicer.quotas = Quotas(max_spec_bytes=a + size)  # the limit itself is allowed
    await create(cluster, b)


async def test_growing_a_spec_counts_its_new_size_instead_of_its_old(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    await create(cluster, spec("a", env={"K": "v" * 1000}))
    bigger = spec("a", env={"K": "v" * 3000})
    servicer.quotas = Quotas(max_spec_bytes=bigger.ByteSize())
    got = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=bigger))
    assert len(got.spec.env["K"]) == 3000


async def test_a_cluster_over_a_lowered_spec_quota_may_change_a_spec_of_the_same_size(
    cluster: Cluster,
) -> None:
    api, servicer = parts(cluster)
    await create(cluster, spec("a", env={"K": "v" * 1000}))
    # The spec as stored (defaults filled in), so the request is exactly as big.
    same = convert.spec_to_pb(servicer.repo.workloads["a"].spec)
    same.env["K"] = "w" * 1000
    assert same.ByteSize() == stored_size(servicer, "a")
    servicer.quotas = Quotas(max_spec_bytes=100)
    got = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=same))
    assert got.spec.env["K"] == "w" * 1000


async def test_the_spec_quota_counts_each_workloads_current_spec(cluster: Cluster) -> None:
    """The sizes are cached per spec: a workload's new spec is counted at its new size."""
    api, servicer = parts(cluster)
    await create(cluster, spec("a", env={"K": "v" * 100}))
    await create(cluster, spec("b"))  # counts (and caches) a's small spec
    await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("a", env={"K": "v" * 5000})))
    c = spec("c")
    total = stored_size(servicer, "a") + stored_size(servicer, "b") + c.ByteSize()
    servicer.quotas = Quotas(max_spec_bytes=total - 1)
    assert await error(create(cluster, c)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"quota max_spec_bytes: the workloads' specs would take {total} bytes, over the"
        f" cluster's limit of {total - 1} (this spec: {c.ByteSize()} bytes)",
    )


async def test_the_spec_size_cache_keeps_only_the_current_workloads(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    await create(cluster, spec("a"))
    await create(cluster, spec("b"))
    await create(cluster, spec("c"))  # counts a and b
    assert sorted(servicer._spec_sizes) == ["a", "b"]
    await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="b"))
    await eventually(lambda: _true("b" not in servicer.repo.workloads))
    await create(cluster, spec("d"))  # counts a and c, forgets b
    assert sorted(servicer._spec_sizes) == ["a", "c"]


# ---- workloads ----


async def test_names_are_checked_with_the_field_named(cluster: Cluster) -> None:
    api, _ = parts(cluster)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    name = BAD_NAME.format(field="name")
    assert await error(api.GetWorkload(pb.GetWorkloadRequest(name="Bad_Name"))) == (invalid, name)
    assert await error(api.GetWorkload(pb.GetWorkloadRequest())) == (invalid, "name is required")
    assert await error(api.DeleteWorkload(pb.DeleteWorkloadRequest(name="Bad_Name"))) == (
        invalid,
        name,
    )
    assert await error(api.GetNode(pb.GetNodeRequest(name="Bad_Name"))) == (invalid, name)
    assert await error(api.CordonNode(pb.CordonNodeRequest(name="Bad_Name"))) == (invalid, name)
    workload = BAD_NAME.format(field="workload")
    assert await error(api.ListInstances(pb.ListInstancesRequest(workload="Bad_Name"))) == (
        invalid,
        workload,
    )
    for rpc in (api.WatchEvents, api.WatchEventBatches):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in rpc(pb.WatchEventsRequest(workload="Bad_Name")):
                pass
        assert (info.value.code(), info.value.details()) == (invalid, workload)


async def test_create_get_update_delete_answer_with_the_stored_record(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    created = await create(cluster, spec("web", replicas=1))
    assert (created.spec.name, created.generation, created.deleting) == ("web", 1, False)
    assert (created.created_by, created.updated_by) == ("admin/admin", "admin/admin")
    assert await error(create(cluster, spec("web"))) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "workload 'web' already exists",
    )
    got = await api.GetWorkload(pb.GetWorkloadRequest(name="web"))
    assert got.spec == created.spec and got.create_time == created.create_time
    assert await error(api.GetWorkload(pb.GetWorkloadRequest(name="nope"))) == (
        grpc.StatusCode.NOT_FOUND,
        "workload 'nope' not found",
    )

    # The same spec again changes nothing; replicas alone keep the generation; a change to
    # what runs makes the next one.
    writes = record_writes(servicer, "UpdateWorkload")
    same = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", replicas=1)))
    assert (same.generation, writes) == (1, [[]])
    before = time.time()
    scaled = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", replicas=2)))
    assert (scaled.generation, scaled.spec.replicas) == (1, 2)
    assert scaled.update_time.ToNanoseconds() >= before * 1e9 and scaled.updated_by == "admin/admin"
    changed = await api.UpdateWorkload(
        pb.UpdateWorkloadRequest(spec=spec("web", replicas=2, command=["sleep", "7"]))
    )
    assert (changed.generation, list(changed.spec.command)) == (2, ["sleep", "7"])
    stored = servicer.repo.workloads["web"]
    assert (stored.generation, stored.spec.command) == (2, ["sleep", "7"])

    deleted = await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))
    assert (deleted.workload.spec.name, deleted.workload.deleting) == ("web", True)
    assert await error(api.DeleteWorkload(pb.DeleteWorkloadRequest(name="nope"))) == (
        grpc.StatusCode.NOT_FOUND,
        "workload 'nope' not found",
    )


async def test_updating_a_workload_being_deleted_is_a_conflict(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    await create(cluster, spec("web"))

    # Marked deleting with the reconciler idle, so the record stays until the update.
    async def idle() -> None:
        return None

    servicer.reconciler.reconcile_once = idle  # type: ignore[method-assign]
    old = servicer.repo.workloads["web"]
    changes = [Change("workloads", "web", old.model_copy(update={"deleting": True}))]
    await servicer.repo.mutate(lambda: changes)
    assert await error(api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", 1)))) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "workload 'web' is being deleted",
    )
    assert servicer.repo.workloads["web"].spec.replicas == 0


async def test_a_new_workload_keeps_who_made_it(cluster: Cluster) -> None:
    _, servicer = parts(cluster)
    await create(cluster, spec("web"))
    w: Workload = servicer.repo.workloads["web"]
    assert (w.created_by, w.updated_by) == ("admin/admin", "admin/admin")
    assert isinstance(w.spec, WorkloadSpec)


# ---- instances ----


async def test_get_instance_answers_the_stored_one_or_names_what_is_missing(
    cluster: Cluster,
) -> None:
    api, servicer = parts(cluster)
    await create(cluster, spec("web", replicas=1))
    [inst] = await eventually(lambda: cluster.instances("web"))
    got = await api.GetInstance(pb.GetInstanceRequest(name=inst.name))
    stored = servicer.repo.instances[inst.name]
    assert (got.name, got.workload, got.generation) == (inst.name, "web", stored.generation)
    assert await error(api.GetInstance(pb.GetInstanceRequest())) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "name: is required",
    )
    assert await error(api.GetInstance(pb.GetInstanceRequest(name="web-x"))) == (
        grpc.StatusCode.NOT_FOUND,
        "instance 'web-x' not found",
    )


async def test_list_instances_sorts_and_filters(cluster: Cluster) -> None:
    api, _ = parts(cluster)
    await create(cluster, spec("b", replicas=2))
    await create(cluster, spec("a", replicas=1))

    async def all_running() -> list[pb.Instance] | None:
        got = await cluster.instances()
        return got if [i.phase for i in got] == [pb.Instance.RUNNING] * 3 else None

    listed = await eventually(all_running)
    assert [i.workload for i in listed] == ["a", "b", "b"]
    assert listed[1].create_time.ToNanoseconds() <= listed[2].create_time.ToNanoseconds()
    assert [i.name for i in await cluster.instances("b")] == [i.name for i in listed[1:]]
    on_node = await api.ListInstances(pb.ListInstancesRequest(node="node-1"))
    assert [i.name for i in on_node.instances] == [i.name for i in listed]
    elsewhere = await api.ListInstances(pb.ListInstancesRequest(node="node-9"))
    assert list(elsewhere.instances) == []
    running = await api.ListInstances(pb.ListInstancesRequest(phase=pb.Instance.RUNNING))
    assert [i.name for i in running.instances] == [i.name for i in listed]
    pending = await api.ListInstances(pb.ListInstancesRequest(phase=pb.Instance.PENDING))
    assert list(pending.instances) == []


# ---- nodes ----


async def test_cordon_drain_uncordon_store_and_send_both_flags(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    name = "node-1"
    writes = record_writes(servicer, "_set_node")

    async def flags(expected: tuple[bool, bool]) -> None:
        node = servicer.repo.nodes[name]
        # Exactly the bools: the stored record is what a restarted controller reads back.
        assert (node.schedulable, node.draining) == expected
        assert all(type(v) is bool for v in (node.schedulable, node.draining))
        record = cluster.scheduler.registry.get(name)
        assert record is not None and (record.schedulable, record.draining) == expected

    got = await api.DrainNode(pb.DrainNodeRequest(name=name))
    assert (got.name, got.schedulable, got.draining) == (name, False, True)
    await flags((False, True))
    got = await api.CordonNode(pb.CordonNodeRequest(name=name))
    assert (got.schedulable, got.draining) == (False, False)
    await flags((False, False))
    await api.CordonNode(pb.CordonNodeRequest(name=name))  # already so: nothing written
    await flags((False, False))
    got = await api.UncordonNode(pb.UncordonNodeRequest(name=name))
    assert (got.schedulable, got.draining) == (True, False)
    await flags((True, False))
    await api.DrainNode(pb.DrainNodeRequest(name=name))
    got = await api.UncordonNode(pb.UncordonNodeRequest(name=name))
    await flags((True, False))
    assert [len(w) for w in writes] == [1, 1, 0, 1, 1, 1]
    got = await api.GetNode(pb.GetNodeRequest(name=name))
    assert (got.name, got.schedulable, got.draining) == (name, True, False)
    assert await error(api.DrainNode(pb.DrainNodeRequest(name="node-9"))) == (
        grpc.StatusCode.NOT_FOUND,
        "node 'node-9' not found",
    )


# ---- events ----


def workload_change(name: str, generation: int, **env: str) -> Change:
    w = Workload(
        spec=WorkloadSpec(name=name, kind="PROCESS", command=["true"], env=env),
        generation=generation,
    )
    return Change("workloads", name, w)


async def subscribed(cluster: Cluster, count: int) -> None:
    _, servicer = parts(cluster)

    async def there() -> bool:
        return len(servicer.events.subscribers) == count

    await eventually(there, timeout=10)


async def test_watch_events_sends_each_queued_event_in_order(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    stream = api.WatchEvents(pb.WatchEventsRequest(workload="web"))
    await subscribed(cluster, 1)
    # Queued all at once, before the server sends any.
    for generation in range(1, 6):
        servicer.events.on_change(workload_change("web", generation), None)
        servicer.events.on_change(workload_change("other", generation), None)
    seen: list[int] = []
    async with asyncio.timeout(10):
        async for ev in stream:
            assert ev.workload.spec.name == "web"
            seen.append(ev.workload.generation)
            if len(seen) == 5:
                break
    assert seen == [1, 2, 3, 4, 5]
    stream.cancel()
    # The server lets go of a subscriber whose client left.
    await subscribed(cluster, 0)


async def test_watch_batches_are_bounded_in_events_and_bytes(cluster: Cluster) -> None:
    api, servicer = parts(cluster)
    stream = api.WatchEventBatches(pb.WatchEventsRequest(workload="web"))
    await subscribed(cluster, 1)
    count = MAX_EVENT_BATCH + MAX_EVENT_BATCH // 2
    for generation in range(1, count + 1):
        servicer.events.on_change(workload_change("web", generation), None)
    sizes: list[int] = []
    generations: list[int] = []
    async with asyncio.timeout(20):
        async for batch in stream:
            sizes.append(len(batch.events))
            generations += [e.workload.generation for e in batch.events]
            if len(generations) == count:
                break
    assert sizes == [MAX_EVENT_BATCH, count - MAX_EVENT_BATCH]
    assert generations == list(range(1, count + 1))

    # Big events: as many as fit in MAX_BATCH_BYTES go together.
    big = {f"K{i}": "x" * 100_000 for i in range(9)}  # about 900 kB an event
    for generation in range(1, 11):
        servicer.events.on_change(workload_change("web", generation, **big), None)
    per_batch = []
    got = 0
    async with asyncio.timeout(20):
        async for batch in stream:
            per_batch.append(len(batch.events))
            assert sum(e.ByteSize() for e in batch.events) <= MAX_BATCH_BYTES
            got += len(batch.events)
            if got == 10:
                break
    assert per_batch == [3, 3, 3, 1]
    stream.cancel()


async def test_a_cut_off_subscriber_is_told_why_exactly(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orka.controller import events

    api, servicer = parts(cluster)
    monkeypatch.setattr(events, "MAX_BACKLOG", 3)
    stream = api.WatchEvents(pb.WatchEventsRequest(workload="web"))
    await subscribed(cluster, 1)
    for generation in range(1, 6):
        servicer.events.on_change(workload_change("web", generation), None)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with asyncio.timeout(10):
            async for _ in stream:
                pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.fullmatch(
        r"this subscriber fell 3 events behind \(\d+ bytes\) and was cut off after revision"
        r" (\d+); watch again with since_revision=\1",
        info.value.details() or "",
    )
    # Its details say a retry (a new subscription) may succeed in a second.
    told = from_rpc_error(info.value)
    assert (type(told), told.retry_after) == (ResourceExhausted, 1.0)


async def _true(value: bool) -> bool:
    return value
