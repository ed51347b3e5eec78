"""Optimistic concurrency on the real API (AIP-154): a stale etag on Update, Delete, Cordon,
Uncordon or Drain fails with ABORTED and changes nothing; the current one or none at all
works; and an etag moves only with what users write, never with status or heartbeats."""

from __future__ import annotations

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.controller.api import ControllerApi
from orka.models import Node, Workload
from tests.integration.cluster import Cluster, eventually
from tests.integration.cluster import process_spec as spec

REREAD = "re-read it and apply your change again"


def servicer(cluster: Cluster) -> ControllerApi:
    assert cluster.controller is not None
    return cluster.controller.api


def stored(cluster: Cluster, name: str) -> Workload:
    return servicer(cluster).repo.workloads[name]


def written(w: Workload) -> tuple[object, ...]:
    """What users write of a workload (its status is the reconciler's, and may move)."""
    return (w.spec, w.generation, w.deleting, w.etag, w.created_at, w.updated_by)


async def aborted(call: object) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.ABORTED, info.value.details()
    return info.value.details() or ""


async def test_a_stale_etag_on_update_is_aborted_and_changes_nothing(cluster: Cluster) -> None:
    api = cluster.api
    assert api is not None
    created = await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web")))
    read = created.etag
    # Someone else changes what runs (no etag: the last writer wins, as before etags).
    other = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", command=["a"])))
    assert other.etag != read and other.generation == 2
    before = stored(cluster, "web")

    stale = pb.UpdateWorkloadRequest(spec=spec("web", command=["b"]), etag=read)
    details = await aborted(api.UpdateWorkload(stale))
    assert details == (
        f"workload 'web' was changed since it was read (etag {read!r} is stale,"
        f" now {other.etag!r}); {REREAD}"
    )
    after = stored(cluster, "web")
    assert written(after) == written(before)
    assert (after.spec.command, after.generation) == (["a"], 2)

    # The etag as read now works, and the write draws the next one.
    fresh = pb.UpdateWorkloadRequest(spec=spec("web", command=["b"]), etag=other.etag)
    done = await api.UpdateWorkload(fresh)
    assert (list(done.spec.command), done.generation) == (["b"], 3)
    assert done.etag not in (read, other.etag) and done.etag == stored(cluster, "web").etag
    # An update that changes nothing keeps the etag (nothing a user wrote changed).
    same = await api.UpdateWorkload(
        pb.UpdateWorkloadRequest(spec=spec("web", command=["b"]), etag=done.etag)
    )
    assert same.etag == done.etag


async def test_a_stale_etag_on_delete_is_aborted_and_changes_nothing(cluster: Cluster) -> None:
    api = cluster.api
    assert api is not None
    created = await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web")))
    scaled = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", replicas=1)))
    before = stored(cluster, "web")

    details = await aborted(
        api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web", etag=created.etag))
    )
    assert details.endswith(REREAD)
    after = stored(cluster, "web")
    assert written(after) == written(before)
    assert (after.deleting, after.spec.replicas, after.etag) == (False, 1, scaled.etag)

    resp = await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web", etag=scaled.etag))
    assert resp.workload.deleting and resp.workload.etag != scaled.etag


async def test_no_etag_still_updates_and_deletes(cluster: Cluster) -> None:
    api = cluster.api
    assert api is not None
    await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web")))
    got = await api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", command=["x"])))
    assert list(got.spec.command) == ["x"]
    resp = await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web"))
    assert resp.workload.deleting


async def test_status_churn_keeps_the_etag_and_a_re_created_workload_gets_a_new_one(
    cluster: Cluster,
) -> None:
    api = cluster.api
    assert api is not None
    created = await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", replicas=1)))

    async def running() -> pb.Workload | None:
        w = await api.GetWorkload(pb.GetWorkloadRequest(name="web"))
        return w if w.status.running == 1 else None

    # The reconciler rewrote the status (and update_time) meanwhile; the etag stayed.
    now = await eventually(running)
    assert now.update_time != created.update_time
    assert now.etag == created.etag
    # So an apply racing the reconciler is not refused for nothing.
    applied = await api.UpdateWorkload(
        pb.UpdateWorkloadRequest(spec=spec("web", replicas=2), etag=created.etag)
    )
    assert applied.spec.replicas == 2

    deleted = await api.DeleteWorkload(pb.DeleteWorkloadRequest(name="web", etag=applied.etag))

    async def gone() -> bool:
        return "web" not in servicer(cluster).repo.workloads

    await eventually(gone)
    again = await api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", replicas=2)))
    assert again.etag not in (created.etag, applied.etag, deleted.workload.etag)
    # The etag read before the delete cannot change the new workload of the same name.
    await aborted(api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web"), etag=applied.etag)))


def flags(cluster: Cluster, name: str) -> tuple[bool, bool]:
    node: Node = servicer(cluster).repo.nodes[name]
    return node.schedulable, node.draining


async def test_a_stale_node_etag_is_aborted_and_heartbeats_keep_it(cluster: Cluster) -> None:
    api = cluster.api
    assert api is not None
    name = "node-1"
    first = await api.GetNode(pb.GetNodeRequest(name=name))

    async def beat_again() -> pb.Node | None:
        n = await api.GetNode(pb.GetNodeRequest(name=name))
        return n if n.last_heartbeat_time != first.last_heartbeat_time else None

    later = await eventually(beat_again)
    assert later.etag == first.etag  # heartbeats are not what users write

    cordoned = await api.CordonNode(pb.CordonNodeRequest(name=name, etag=first.etag))
    assert (cordoned.schedulable, cordoned.etag != first.etag) == (False, True)
    for call in (
        api.UncordonNode(pb.UncordonNodeRequest(name=name, etag=first.etag)),
        api.DrainNode(pb.DrainNodeRequest(name=name, etag=first.etag)),
    ):
        details = await aborted(call)
        assert details.startswith(f"node {name!r} was changed since it was read")
        assert flags(cluster, name) == (False, False)
    assert cluster.scheduler.registry.get(name).schedulable is False  # type: ignore[union-attr]

    drained = await api.DrainNode(pb.DrainNodeRequest(name=name, etag=cordoned.etag))
    assert (drained.draining, flags(cluster, name)) == (True, (False, True))
    back = await api.UncordonNode(pb.UncordonNodeRequest(name=name))  # no etag: just done
    assert flags(cluster, name) == (True, False) and back.etag == first.etag
