"""Classes and pools end to end on a real in-process cluster: agents join pools, ListPools counts
how many more of each class fit before and after instances of it are placed, a class resolves
into a workload's resources, and placement says which pool or class rules a node out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from orka.api import controller_pb2 as pb
from orka.api import controller_pb2_grpc as pb_grpc
from orka.errors import AlreadyExists, Conflict, FieldViolation, Invalid, NotFound
from orka.rpc.client import call
from tests.integration.cluster import Cluster, eventually
from tests.integration.orka_cli import orka

MI = 1 << 20
GI = 1 << 30
PROCESS, VM = pb.WorkloadSpec.PROCESS, pb.WorkloadSpec.VM


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    # Usage reports often: ListPools reads `allocated` from the node records they refresh.
    c = Cluster(certs_dir, tmp_path, usage_report_interval=0.2)
    try:
        await c.scheduler.start()
        await c.start_controller()
        # Pool "default": one small node; pool "big": two large ones.
        await c.add_agent("node-1", runtimes=["fake"], cpu_millis=2000, memory_bytes=2 * GI)
        for name in ("node-2", "node-3"):
            await c.add_agent(
                name, runtimes=["fake"], cpu_millis=4000, memory_bytes=8 * GI, pool="big"
            )
        controller = c.controller
        assert controller is not None
        await eventually(lambda: _all_known(c))
        yield c
    finally:
        await c.stop()


async def _all_known(c: Cluster) -> bool:
    assert c.controller is not None
    return all(n in c.controller.repo.nodes for n in ("node-1", "node-2", "node-3"))


def compute(name: str, cpu: int, memory: int, *kinds: int) -> pb.Class:
    return pb.Class(
        name=name,
        compute=pb.Class.Compute(
            resources=pb.Resources(cpu_millis=cpu, memory_bytes=memory), kinds=list(kinds)
        ),
    )


def workload(name: str, replicas: int = 1, **fields: object) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name,
        kind=PROCESS,
        command=["sleep", "1000"],
        replicas=replicas,
        **fields,  # type: ignore[arg-type]
    )


async def pools(api: pb_grpc.ControllerStub) -> dict[str, pb.Pool]:
    resp = await api.ListPools(pb.ListPoolsRequest())
    return {p.name: p for p in resp.pools}


async def counts(api: pb_grpc.ControllerStub) -> dict[str, dict[str, int]]:
    return {
        name: {c.class_name: c.count for c in p.available_classes}
        for name, p in (await pools(api)).items()
    }


async def reasons(api: pb_grpc.ControllerStub, name: str) -> tuple[list[str], bool] | None:
    w = await api.GetWorkload(pb.GetWorkloadRequest(name=name))
    found = list(w.status.unschedulable_reasons)
    return (found, w.status.unschedulable_unresolvable) if found else None


async def test_pools_count_classes_and_placement_honours_them(cluster: Cluster) -> None:
    api, controller = cluster.api, cluster.controller
    assert api is not None and controller is not None

    # ---- classes: create, read, list, bad input ----
    small = await call(api.CreateClass, pb.CreateClassRequest(spec=compute("small", 500, 512 * MI)))
    assert (small.name, small.compute.resources.cpu_millis, small.etag != "") == (
        "small",
        500,
        True,
    )
    await call(api.CreateClass, pb.CreateClassRequest(spec=compute("large", 3000, 4 * GI)))
    await call(api.CreateClass, pb.CreateClassRequest(spec=compute("huge", 16000, GI)))
    await call(api.CreateClass, pb.CreateClassRequest(spec=compute("vm-only", 500, 0, VM)))
    vol = pb.Class(name="fast", volume=pb.Class.Volume(max_size_bytes=GI, backends=["ext4"]))
    await call(api.CreateClass, pb.CreateClassRequest(spec=vol))
    with pytest.raises(AlreadyExists):
        await call(api.CreateClass, pb.CreateClassRequest(spec=compute("small", 1, 1)))
    with pytest.raises(Invalid) as err:
        await call(api.CreateClass, pb.CreateClassRequest(spec=compute("empty", 0, 0)))
    assert [f.field for f in err.value.fields] == ["spec.compute.resources"]
    with pytest.raises(Invalid) as err:
        await call(api.CreateClass, pb.CreateClassRequest(spec=pb.Class(name="shapeless")))
    assert [f.field for f in err.value.fields] == ["spec.compute"]
    first = await call(api.ListClasses, pb.ListClassesRequest(page_size=3))
    rest = await call(
        api.ListClasses, pb.ListClassesRequest(page_size=3, page_token=first.next_page_token)
    )
    assert [c.name for c in [*first.classes, *rest.classes]] == [
        "fast",
        "huge",
        "large",
        "small",
        "vm-only",
    ]
    assert rest.next_page_token == ""

    # ---- pools before anything runs ----
    ps = await pools(api)
    assert sorted(ps) == ["big", "default"]
    page = await call(api.ListPools, pb.ListPoolsRequest(page_size=1))
    after = await call(
        api.ListPools, pb.ListPoolsRequest(page_size=1, page_token=page.next_page_token)
    )
    assert [p.name for p in [*page.pools, *after.pools]] == ["big", "default"]
    assert after.next_page_token == ""
    assert (ps["big"].node_count, ps["big"].ready_node_count) == (2, 2)
    assert (ps["big"].capacity.cpu_millis, ps["big"].allocatable.memory_bytes) == (8000, 16 * GI)
    # default: 2000m/500m = 4 and 2Gi/512Mi = 4 small; large and huge fit none of its nodes.
    # big: two nodes of min(4000/500, 8Gi/512Mi) = 8 small and min(4000/3000, 8Gi/4Gi) = 1 large.
    # vm-only needs a libvirt driver: the fake one stands in for any.
    assert await counts(api) == {
        "default": {"small": 4, "vm-only": 4},
        "big": {"small": 16, "large": 2, "vm-only": 16},
    }

    # ---- class resolution: the class fills the resources the spec leaves at 0 ----
    await call(
        api.CreateWorkload,
        pb.CreateWorkloadRequest(spec=workload("s", 3, class_name="small", pool="big")),
    )
    stored = await call(api.GetWorkload, pb.GetWorkloadRequest(name="s"))
    assert (stored.spec.resources.cpu_millis, stored.spec.resources.memory_bytes) == (500, 512 * MI)
    explicit = workload("t", 0, class_name="small", resources=pb.Resources(cpu_millis=700))
    await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=explicit))
    t = await call(api.GetWorkload, pb.GetWorkloadRequest(name="t"))
    assert (t.spec.resources.cpu_millis, t.spec.resources.memory_bytes) == (700, 512 * MI)

    # ---- placing three small ones in pool big takes 3 of its 16 ----
    await eventually(lambda: _running_on(cluster, "s", 3))
    nodes = {i.node for i in await cluster.instances("s")}
    assert nodes <= {"node-2", "node-3"}

    async def big_counts() -> dict[str, int] | None:
        c = (await counts(api))["big"]
        return c if c["small"] == 13 else None

    # One node holds 2 small (3000m left: 1 large), the other 1 (3500m left: 1 large).
    assert await eventually(big_counts) == {"small": 13, "large": 2, "vm-only": 13}
    assert (await counts(api))["default"] == {"small": 4, "vm-only": 4}
    ps = await pools(api)
    assert ps["big"].allocated.cpu_millis == 1500

    # A large one goes to pool big on its own (the class filter rules node-1 out).
    await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=workload("l", class_name="large")))
    [inst] = await eventually(lambda: _running_on(cluster, "l", 1))
    assert inst.node in {"node-2", "node-3"}

    async def after_large() -> dict[str, int] | None:
        c = (await counts(api))["big"]
        return c if c["large"] == 1 else None

    assert await eventually(after_large) == {"small": 7, "large": 1, "vm-only": 7}

    # ---- what no pool supports, or a pool that has no such node ----
    await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=workload("h", class_name="huge")))
    assert await eventually(lambda: reasons(api, "h")) == (
        ["3 nodes: cannot host class huge"],
        True,
    )
    await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=workload("g", pool="gpu")))
    assert await eventually(lambda: reasons(api, "g")) == (
        ["2 nodes: node is in pool big; 1 node: node is in pool default"],
        True,
    )
    # Pool and class together: the pool is named first on the nodes it rules out.
    await call(
        api.CreateWorkload,
        pb.CreateWorkloadRequest(spec=workload("lg", class_name="large", pool="default")),
    )
    assert await eventually(lambda: reasons(api, "lg")) == (
        ["2 nodes: node is in pool big; 1 node: cannot host class large"],
        True,
    )

    # ---- bad class references: INVALID_ARGUMENT naming spec.class_name, nothing stored ----
    before = dict(controller.repo.workloads)
    for bad, words in (
        (workload("x", class_name="nosuch"), "class 'nosuch' does not exist"),
        (workload("x", class_name="fast"), "is a VOLUME class, not a COMPUTE class"),
        (workload("x", class_name="vm-only"), "is for VM workloads, not PROCESS"),
    ):
        with pytest.raises(Invalid) as err:
            await call(api.CreateWorkload, pb.CreateWorkloadRequest(spec=bad))
        assert [f.field for f in err.value.fields] == ["spec.class_name"]
        assert words in err.value.message
    with pytest.raises(Invalid) as err:
        await call(
            api.UpdateWorkload,
            pb.UpdateWorkloadRequest(spec=workload("s", 3, class_name="nosuch", pool="big")),
        )
    assert err.value.fields == [FieldViolation("spec.class_name", "class 'nosuch' does not exist")]
    assert controller.repo.workloads == before

    # ---- changing a class never resizes what is stored; deleting a used one is refused ----
    old = await call(api.GetClass, pb.GetClassRequest(name="small"))
    bigger = compute("small", 1000, 512 * MI)
    changed = await call(api.UpdateClass, pb.UpdateClassRequest(spec=bigger, etag=old.etag))
    assert changed.compute.resources.cpu_millis == 1000 and changed.etag != old.etag
    s = await call(api.GetWorkload, pb.GetWorkloadRequest(name="s"))
    assert s.spec.resources.cpu_millis == 500
    with pytest.raises(Invalid) as err:
        await call(
            api.UpdateClass, pb.UpdateClassRequest(spec=pb.Class(name="small", volume=vol.volume))
        )
    assert [f.field for f in err.value.fields] == ["spec.volume"]
    with pytest.raises(Conflict) as err:
        await call(api.DeleteClass, pb.DeleteClassRequest(name="small"))
    assert "workload s, workload t" in err.value.message
    assert "small" in controller.repo.classes
    gone = await call(api.DeleteClass, pb.DeleteClassRequest(name="vm-only"))
    assert gone.name == "vm-only"
    with pytest.raises(NotFound):
        await call(api.GetClass, pb.GetClassRequest(name="vm-only"))
    assert sorted(controller.repo.classes) == ["fast", "huge", "large", "small"]

    # ---- the CLI: a class and a workload naming it from one file, then the pools ----
    manifest = (
        b"name: w-cli\nkind: process\ncommand: sleep 1000\nclass: tiny\npool: default\n---\n"
        b"kind: class\nname: tiny\ncpu: 250m\nmemory: 256Mi\n"
    )
    code, out, err = await orka(cluster, "apply", "-f", "-", stdin=manifest)
    assert code == 0, err
    assert out.decode().splitlines() == ["class/tiny created", "workload/w-cli created"]
    [inst] = await eventually(lambda: _running_on(cluster, "w-cli", 1))
    assert inst.node == "node-1"

    async def default_counts() -> dict[str, int] | None:
        c = (await counts(api))["default"]
        return c if c.get("tiny") == 7 else None

    await eventually(default_counts)
    code, out, err = await orka(cluster, "get", "pools")
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in out.decode().splitlines()}
    assert rows["POOL"] == ["POOL", "NODES", "READY", "CPU", "MEMORY", "CLASSES"]
    # small is 1000m now: 1750m free / 1000m = 1; tiny: 1750m / 250m = 7 and 1792Mi / 256Mi = 7.
    assert rows["default"] == ["default", "1", "1", "250m/2", "256Mi/2Gi", "small=1", "tiny=7"]
    assert rows["big"][:3] == ["big", "2", "2"]
    assert rows["big"][5:] == ["large=1", "small=3", "tiny=14"]
    code, out, err = await orka(cluster, "get", "class", "tiny", "-o", "json")
    assert code == 0, err
    assert json.loads(out)["compute"]["resources"] == {"cpu_millis": 250, "memory_bytes": 256 * MI}
    code, out, err = await orka(cluster, "delete", "class", "tiny")
    assert code != 0 and b"is used by workload w-cli" in err, err


async def _running_on(c: Cluster, workload: str, n: int) -> list[pb.Instance] | None:
    running = await c.running(workload)
    return running if len(running) == n else None
