"""The controller's volume state machine (orka/controller/volumes.py): table tests of each
transition, deletion with a workload, node picking, and the keeper's commands against a
recording link on a real (memory) store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.controller import volumes as v
from orka.controller import volumes_api
from orka.controller.commands import NodeCommand, NodeSeen, NodeSynced, VolumeReported
from orka.controller.link import CommandResult, command_to_pb
from orka.controller.repo import Change, Repo
from orka.errors import Conflict, Invalid
from orka.models import (
    Class,
    ComputeShape,
    Instance,
    InstancePhase,
    Node,
    NodeState,
    Resources,
    Volume,
    VolumeMount,
    VolumeReport,
    VolumeShape,
    VolumeSpec,
    VolumeTemplate,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)
from orka.store.memory import MemoryStore

S = VolumeState = v.VolumeState
MI = 1 << 20


def vol(
    name: str = "data-1", state: VolumeState = S.AVAILABLE, node: str = "n1", **kw: Any
) -> Volume:
    size = kw.pop("size", 64 * MI)
    spec = VolumeSpec(
        name=name,
        size_bytes=size,
        class_name=kw.pop("class_name", ""),
        pool=kw.pop("pool", ""),
        backend=kw.pop("backend", ""),
    )
    return Volume(spec=spec, state=state, node=node, **kw)


def report(state: VolumeState, *attached: str, name: str = "data-1", msg: str = "") -> VolumeReport:
    return VolumeReport(name=name, state=state, attached_to=list(attached), message=msg)


# ---- transitions ----


@pytest.mark.parametrize(
    ("before", "node", "r", "exists", "after"),
    [
        # (state before, reporting node, report, workload exists, state after; None: no change)
        (S.PENDING, "n1", report(S.PENDING), True, None),
        (S.PENDING, "n1", report(S.AVAILABLE), True, S.AVAILABLE),
        (S.AVAILABLE, "n1", report(S.ATTACHED, "web-a"), True, S.ATTACHED),
        (S.ATTACHED, "n1", report(S.AVAILABLE), True, S.AVAILABLE),
        (S.PENDING, "n1", report(S.FAILED, msg="mkfs failed"), True, S.FAILED),
        (S.LOST, "n1", report(S.AVAILABLE), True, S.AVAILABLE),
        # Only the node it is bound to speaks for it.
        (S.AVAILABLE, "n2", report(S.ATTACHED, "web-a"), True, None),
        # Being deleted: the ack decides, not a report.
        (S.DELETING, "n1", report(S.AVAILABLE), True, None),
        # An agent never says LOST.
        (S.AVAILABLE, "n1", report(S.LOST), True, None),
    ],
)
def test_reported(
    before: VolumeState, node: str, r: VolumeReport, exists: bool, after: VolumeState | None
) -> None:
    new = v.reported(vol(state=before), node, r, exists, 5.0)
    if after is None:
        assert new is None
        return
    assert new is not None and new.state is after and new.updated_at == 5.0
    assert new.attached_to == (r.attached_to if after is S.ATTACHED else [])
    assert new.message == (r.message if after is S.FAILED else "")


def test_template_volume_of_a_gone_workload_reports_released() -> None:
    t = vol(state=S.PENDING, workload="web", ordinal=1)
    assert v.reported(t, "n1", report(S.AVAILABLE), False, 1.0).state is S.RELEASED  # type: ignore[union-attr]
    assert v.reported(t, "n1", report(S.AVAILABLE), True, 1.0).state is S.AVAILABLE  # type: ignore[union-attr]


def test_unbound_volume_ignores_reports() -> None:
    assert v.reported(vol(state=S.PENDING, node=""), "n1", report(S.AVAILABLE), True, 1.0) is None


@pytest.mark.parametrize(
    ("before", "after_state", "after_node"),
    [
        (S.AVAILABLE, S.LOST, "n1"),
        (S.ATTACHED, S.LOST, "n1"),
        (S.RELEASED, S.LOST, "n1"),
        (S.FAILED, S.LOST, "n1"),
        (S.PENDING, S.PENDING, ""),  # bound, never made: placed again
        (S.LOST, None, "n1"),
        (S.DELETING, None, "n1"),
    ],
)
def test_node_lost(before: VolumeState, after_state: VolumeState | None, after_node: str) -> None:
    new = v.node_lost(vol(state=before, attached_to=["x"]), 1.0)
    if after_state is None:
        assert new is None
        return
    assert new is not None and (new.state, new.node) == (after_state, after_node)
    if after_state is S.LOST:
        assert new.attached_to == [] and "node n1 is lost" in new.message


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (S.AVAILABLE, S.LOST),
        (S.ATTACHED, S.LOST),
        (S.RELEASED, S.LOST),
        (S.PENDING, None),
        (S.FAILED, None),
        (S.DELETING, None),
    ],
)
def test_not_listed_at_register(before: VolumeState, after: VolumeState | None) -> None:
    new = v.not_listed(vol(state=before), 1.0)
    assert (new.state if new else None) is after
    if new is not None:
        assert "registered again without it" in new.message


@pytest.mark.parametrize(
    ("before", "node", "after"),
    [
        (S.PENDING, "", None),  # nothing anywhere: removed at once
        (S.LOST, "n1", None),  # its node is gone: removed at once
        (S.AVAILABLE, "n1", S.DELETING),
        (S.FAILED, "n1", S.DELETING),
        (S.RELEASED, "n1", S.DELETING),
        (S.PENDING, "n1", S.DELETING),
    ],
)
def test_deleting(before: VolumeState, node: str, after: VolumeState | None) -> None:
    new = v.deleting(vol(state=before, node=node), 1.0)
    assert (new.state if new else None) is after


# ---- with a repo ----


@dataclass
class RecordingLink:
    """Records the commands as sent on the wire; answers each with `answer` (ok by default)."""

    sent: list[apb.NodeCommand] = field(default_factory=list)
    answer: CommandResult = field(default_factory=lambda: CommandResult(ok=True))

    async def command(self, cmds: Sequence[NodeCommand]) -> list[CommandResult]:
        self.sent.extend(command_to_pb(c) for c in cmds)
        return [self.answer for _ in cmds]


@pytest.fixture
async def repo() -> AsyncIterator[Repo]:
    store = MemoryStore()
    await store.open()
    r = Repo(store)
    r.writable = True
    yield r
    await store.close()


async def put(repo: Repo, *objs: Any) -> None:
    kinds = {Workload: "workloads", Instance: "instances", Node: "nodes", Volume: "volumes"}
    kinds[Class] = "classes"
    await repo.mutate(lambda: [Change(kinds[type(o)], o.name, o) for o in objs])


def workload(name: str, *volumes: str, template: bool = False, **kw: Any) -> Workload:
    spec = WorkloadSpec(
        name=name,
        kind=WorkloadKind.PROCESS,
        command=["sleep", "1"],
        replicas=1,
        volumes=[VolumeMount(volume=n) for n in volumes],
        volume_template=VolumeTemplate(name="t", size_bytes=64 * MI) if template else None,
    )
    return Workload(spec=spec, **kw)


def node(name: str, free: int = 1 << 30, **kw: Any) -> Node:
    kw.setdefault("volume_backends", ["ext4"])
    return Node(
        name=name,
        capacity=Resources(cpu_millis=1000, memory_bytes=1 << 30),
        volume_capacity_bytes=free,
        **kw,
    )


async def test_workload_removed_without_volumes_releases_its_template_volumes(repo: Repo) -> None:
    w = workload("web", "shared", template=True)
    await put(repo, w, vol("shared"), vol("t-web-0", workload="web"), vol("t-db-0", workload="db"))
    changes = v.workload_removed(repo, w, 1.0)
    assert {(c.name, c.value.state if c.value else None) for c in changes} == {
        ("t-web-0", S.RELEASED)
    }


async def test_workload_removed_with_volumes_deletes_what_no_other_workload_names(
    repo: Repo,
) -> None:
    w = workload("web", "mine", "shared", template=True, deleting=True, delete_volumes=True)
    await put(
        repo,
        w,
        workload("api", "shared"),
        vol("mine"),
        vol("shared"),
        vol("t-web-0", workload="web"),
        vol("t-web-1", state=S.PENDING, node="", workload="web"),
        vol("other"),
    )
    changes = {c.name: c.value for c in v.workload_removed(repo, w, 1.0)}
    assert set(changes) == {"mine", "t-web-0", "t-web-1"}
    assert changes["mine"].state is S.DELETING  # type: ignore[union-attr]
    assert changes["t-web-0"].state is S.DELETING  # type: ignore[union-attr]
    assert changes["t-web-1"] is None  # never made: removed at once


async def test_attached_or_used_volume_is_not_deletable(repo: Repo) -> None:
    await put(repo, workload("web", "data-1"), vol("data-1"))
    v.check_deletable(repo, repo.volumes["data-1"])  # nothing uses it yet
    with pytest.raises(Conflict, match="ATTACHED"):
        v.check_deletable(repo, vol(state=S.ATTACHED, attached_to=["web-a"]))
    await put(repo, Instance(name="web-a", workload="web", node="n1", phase=InstancePhase.STARTING))
    with pytest.raises(Conflict, match="used by instance web-a"):
        v.check_deletable(repo, repo.volumes["data-1"])


def test_pick_node_takes_the_most_free_space_of_its_pool_and_backend() -> None:
    cls = Class(name="c", volume=VolumeShape(backends=["qcow2", "ext4"]))
    nodes = [
        node("a", 1 << 30, pool="p1"),
        node("b", 4 << 30, pool="p2"),
        node("c", 2 << 30, pool="p1", volume_backends=["qcow2"]),
        node("d", 8 << 30, pool="p1", state=NodeState.NOT_READY),
        node("e", 8 << 30, pool="p1", schedulable=False),
        node("f", 3 << 30, pool="p1"),
    ]
    # f has the most room of p1, but 2Gi of it are taken by another volume.
    others = [vol("x", node="f", size=2 << 30)]
    picked = v.pick_node(vol(state=S.PENDING, node="", pool="p1"), cls, nodes, others)
    assert isinstance(picked, tuple) and (picked[0].name, picked[1]) == ("c", "qcow2")
    none = v.pick_node(vol(state=S.PENDING, node="", pool="p3"), cls, nodes, others)
    assert (
        none == "waiting for a node: no READY node of pool p3 offers qcow2 or ext4 with 64Mi free"
    )


async def test_keeper_deletes_on_ack_and_keeps_deleting_on_refusal(repo: Repo) -> None:
    link = RecordingLink(answer=CommandResult(ok=False, error="held by web-a"))
    keeper = v.VolumeKeeper(repo, link)  # type: ignore[arg-type]
    await put(repo, node("n1"), vol("data-1", state=S.DELETING))
    await keeper.pass_once()
    assert [(c.node, c.delete_volume.volume) for c in link.sent] == [("n1", "data-1")]
    assert repo.volumes["data-1"].state is S.DELETING
    assert repo.volumes["data-1"].message == "node n1 refused: held by web-a"
    await keeper.pass_once()
    assert len(link.sent) == 1  # not resent before RESEND_AFTER
    keeper._sent.clear()  # as if RESEND_AFTER had passed
    link.answer = CommandResult(ok=True)
    await keeper.pass_once()
    assert "data-1" not in repo.volumes


async def test_keeper_unanswered_delete_keeps_the_record(repo: Repo) -> None:
    link = RecordingLink(answer=CommandResult(ok=False, error="x", unconfirmed=True))
    keeper = v.VolumeKeeper(repo, link)  # type: ignore[arg-type]
    await put(repo, node("n1"), vol("data-1", state=S.DELETING))
    await keeper.pass_once()
    assert repo.volumes["data-1"].state is S.DELETING and repo.volumes["data-1"].message == ""


async def test_keeper_provisions_an_immediate_volume(repo: Repo) -> None:
    link = RecordingLink()
    keeper = v.VolumeKeeper(repo, link)  # type: ignore[arg-type]
    now = Class(name="now", volume=VolumeShape(immediate=True))
    later = Class(name="later", volume=VolumeShape())
    await put(
        repo,
        now,
        later,
        node("n1", 1 << 30),
        node("n2", 2 << 30, pool="p2"),
        vol("a", state=S.PENDING, node="", class_name="now"),
        vol("b", state=S.PENDING, node="", class_name="later"),
        vol("c", state=S.PENDING, node="", class_name="now", size=4 << 30),
    )
    await keeper.pass_once()
    a = repo.volumes["a"]
    assert (a.node, a.pool, a.backend, a.state) == ("n2", "p2", "ext4", S.PENDING)
    assert [(c.node, c.provision_volume.volume.name) for c in link.sent] == [("n2", "a")]
    assert link.sent[0].provision_volume.volume.size_bytes == 64 * MI
    assert repo.volumes["b"].node == ""  # not immediate: placement binds it
    assert repo.volumes["c"].node == "" and "with 4Gi free" in repo.volumes["c"].message
    # Deleted right after: the delete goes at once (the provision's resend timer is its own).
    await put(repo, repo.volumes["a"].model_copy(update={"state": S.DELETING}))
    await keeper.pass_once()
    assert [(c.node, c.delete_volume.volume) for c in link.sent[1:]] == [("n2", "a")]
    assert "a" not in repo.volumes


async def test_keeper_applies_reports_node_loss_and_sync(repo: Repo) -> None:
    keeper = v.VolumeKeeper(repo, RecordingLink())  # type: ignore[arg-type]
    await put(repo, node("n1"), vol("a", state=S.PENDING), vol("b"), vol("c", state=S.DELETING))
    await keeper.on_updates([VolumeReported("n1", report(S.ATTACHED, "web-x", name="a"))])
    assert repo.volumes["a"].state is S.ATTACHED and repo.volumes["a"].attached_to == ["web-x"]
    await keeper.on_updates([NodeSeen(node("n1", state=NodeState.LOST))])
    assert [repo.volumes[n].state for n in "ab"] == [S.LOST, S.LOST]
    # Back with `a` only: `a` as reported, `b` gone with the node, `c`'s delete is done.
    await keeper.on_updates(
        [NodeSeen(node("n1")), NodeSynced("n1", volumes=[report(S.AVAILABLE, name="a")])]
    )
    assert repo.volumes["a"].state is S.AVAILABLE and repo.volumes["a"].message == ""
    assert repo.volumes["b"].state is S.LOST and "without it" in repo.volumes["b"].message
    assert "c" not in repo.volumes


async def test_keeper_keeps_and_records_a_volume_it_has_no_record_of_at_register(
    repo: Repo,
) -> None:
    link = RecordingLink()
    keeper = v.VolumeKeeper(repo, link)  # type: ignore[arg-type]
    await put(repo, node("n1", pool="fast"), vol("a", node="n2"))
    unknown = report(S.ATTACHED, "web-x", name="gone").model_copy(
        update={"size_bytes": 64 * MI, "backend": "ext4"}
    )
    await keeper.on_updates([NodeSynced("n1", volumes=[unknown, report(S.AVAILABLE, name="a")])])
    # Nothing is deleted unasked: the unknown volume is recorded as its node holds it, and
    # the one whose name now lives on n2 is left alone on n1 and in the store.
    assert link.sent == []
    gone = repo.volumes["gone"]
    assert (gone.node, gone.pool, gone.state, gone.attached_to, gone.spec.size_bytes) == (
        "n1",
        "fast",
        S.ATTACHED,
        ["web-x"],
        64 * MI,
    )
    assert gone.backend == "ext4" and "no record" in gone.message
    assert repo.volumes["a"].node == "n2" and repo.volumes["a"].state is S.AVAILABLE


def test_found_records_only_what_a_node_holds() -> None:
    for state in (S.PENDING, S.DELETING, S.LOST, S.RELEASED):
        r = report(state).model_copy(update={"size_bytes": 64 * MI})
        assert v.found("n1", "default", r, 0.0) is None
    too_small = report(S.AVAILABLE).model_copy(update={"size_bytes": 1})
    assert v.found("n1", "default", too_small, 0.0) is None
    odd = report(S.FAILED, msg="disk").model_copy(update={"size_bytes": MI, "backend": "zfs"})
    kept = v.found("n1", "default", odd, 0.0)
    assert kept is not None and (kept.state, kept.backend, kept.attached_to) == (S.FAILED, "", [])


async def test_create_checks_size_against_the_nodes_and_the_class(repo: Repo) -> None:
    api: Any = SimpleNamespace(repo=repo)
    fast = Class(name="fast", volume=VolumeShape(max_size_bytes=1 << 30, backends=["ext4"]))
    small = Class(name="small", compute=ComputeShape(resources=Resources(cpu_millis=100)))
    await put(repo, fast, small, node("n1", 1 << 30), node("n2", 2 << 30, pool="big"))
    await put(repo, node("n3", 8 << 30, state=NodeState.LEFT))

    def error(**kw: Any) -> str:
        spec = VolumeSpec(name="x", **{"size_bytes": 64 * MI, **kw})
        with pytest.raises(Invalid) as info:
            volumes_api.check_spec(api, spec)
        return f"{info.value.fields[0].field}: {info.value.fields[0].description}"

    assert error(size_bytes=3 << 30) == (
        "spec.size_bytes: 3Gi is larger than any node can hold (largest: 2Gi)"
    )
    assert error(size_bytes=2 << 30, pool="default") == (
        "spec.size_bytes: 2Gi is larger than any node of pool 'default' can hold (largest: 1Gi)"
    )
    assert error(size_bytes=2 << 30, class_name="fast") == (
        "spec.size_bytes: 2Gi is above the maximum of class 'fast' (1Gi)"
    )
    assert error(class_name="fast", backend="qcow2").startswith("spec.backend: 'qcow2' is not")
    assert error(class_name="small") == (
        "spec.class_name: class 'small' is a COMPUTE class, not a VOLUME class"
    )
    assert error(class_name="none") == "spec.class_name: class 'none' not found"
    volumes_api.check_spec(api, VolumeSpec(name="x", size_bytes=2 << 30))
    volumes_api.check_spec(api, VolumeSpec(name="x", size_bytes=8 << 30, pool="new-pool"))


async def test_list_volumes_pages_by_name_with_filters(repo: Repo) -> None:
    api: Any = SimpleNamespace(repo=repo)
    await put(
        repo, vol("a", node="n1"), vol("b", node="n2"), vol("c", node="n1"), vol("d", node="")
    )
    names, token = [], ""
    while True:
        req = pb.ListVolumesRequest(node="n1", page_size=1, page_token=token)
        resp = await volumes_api.list_volumes(api, req, None)
        names += [v.spec.name for v in resp.volumes]
        assert all(v.revision > 0 for v in resp.volumes)
        token = resp.next_page_token
        if not token:
            break
    assert names == ["a", "c"]
    resp = await volumes_api.list_volumes(api, pb.ListVolumesRequest(page_size=3), None)
    assert [v.spec.name for v in resp.volumes] == ["a", "b", "c"] and resp.next_page_token
    other = pb.ListVolumesRequest(node="n2", page_token=resp.next_page_token)
    with pytest.raises(Invalid, match="page_token: was issued for a listing with other filters"):
        await volumes_api.list_volumes(api, other, None)
    with pytest.raises(Invalid, match="node"):
        await volumes_api.list_volumes(api, pb.ListVolumesRequest(node="N 1"), None)
