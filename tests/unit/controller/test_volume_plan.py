"""Volumes in placement: attachments, waiting reasons, binding, template volumes, ordinals."""

from __future__ import annotations

from typing import Any

import pytest

from orka.controller import volume_plan
from orka.controller.volume_plan import Ordinals
from orka.models import (
    Class,
    Instance,
    InstancePhase,
    Node,
    Volume,
    VolumeMount,
    VolumeShape,
    VolumeSpec,
    VolumeState,
    VolumeTemplate,
    Workload,
    WorkloadKind,
    WorkloadSpec,
)

MIB = 1 << 20


def workload(kind: WorkloadKind = WorkloadKind.PROCESS, **fields: Any) -> Workload:
    spec: dict[str, Any] = {"name": "web", "kind": kind, "replicas": 2}
    if kind is WorkloadKind.VM:
        spec["image"] = "/images/disk.qcow2"
    else:
        spec["command"] = ["sleep", "1"]
    spec.update(fields)
    return Workload(spec=WorkloadSpec(**spec))


def inst(name: str = "web-0", ordinal: int = 0, **fields: Any) -> Instance:
    return Instance(name=name, workload="web", ordinal=ordinal, **fields)


def volume(name: str = "data-1", **fields: Any) -> Volume:
    spec = fields.pop("spec", {})
    return Volume(spec=VolumeSpec(name=name, size_bytes=64 * MIB, **spec), **fields)


def test_template_volumes_are_named_after_template_workload_and_ordinal() -> None:
    t = VolumeTemplate(name="data", size_bytes=64 * MIB)
    assert [t.volume_name("db", n) for n in (0, 1, 12)] == ["data-db-0", "data-db-1", "data-db-12"]
    w = workload(volumes=[VolumeMount(volume="shared")], volume_template=t)
    assert volume_plan.volume_names(w.spec, "web", 3) == ("shared", "data-web-3")


@pytest.mark.parametrize(
    ("live", "taken"),
    [
        ([], [0, 1, 2]),
        ([0, 1], [2, 3, 4]),
        ([1, 3], [0, 2, 4]),  # the gaps first: replacements take their predecessor's
    ],
)
def test_ordinals_take_the_lowest_free_ones(live: list[int], taken: list[int]) -> None:
    insts = [inst(f"web-{n}", n) for n in live]
    o = Ordinals(insts, generation=1)
    assert [o.take() for _ in range(3)] == taken


def test_ordinals_of_finished_stopping_or_other_generations_are_free() -> None:
    insts = [
        inst("a", 0, phase=InstancePhase.FAILED),
        inst("b", 1, desired_stop=True),
        inst("c", 2, generation=2),
        inst("d", 3),
    ]
    assert [Ordinals(insts, generation=1).take() for _ in range(1)] == [0]
    o = Ordinals(insts, generation=1)
    assert [o.take(), o.take(), o.take()] == [0, 1, 2]
    # Across generations (a VM rollout that stops first): 2 is held by the new generation.
    o = Ordinals(insts, generation=1, any_generation=True)
    assert [o.take(), o.take(), o.take()] == [0, 1, 4]


def test_attachments_say_where_each_volume_lives_and_which_backend() -> None:
    classes = {
        "fast": Class(name="fast", volume=VolumeShape(backends=["qcow2"])),
        "any": Class(name="any", volume=VolumeShape(backends=["ext4", "qcow2"])),
    }
    w = workload(
        volumes=[
            VolumeMount(volume="bound", mount_path="/b", read_only=True),
            VolumeMount(volume="classy"),
            VolumeMount(volume="plain"),
        ],
        volume_template=VolumeTemplate(name="data", size_bytes=8 * MIB, class_name="any"),
        pool="gpu",
    )
    vols = {
        "bound": volume(
            "bound", node="node-2", pool="slow", backend="ext4", state=VolumeState.ATTACHED
        ),
        "classy": volume("classy", spec={"class_name": "fast", "pool": "fast-pool"}),
        "plain": volume("plain"),
    }
    r = volume_plan.resolve(inst(ordinal=1), w, vols, classes)
    assert r.wait == ""
    got = [(a.name, a.node, a.pool, a.backend, a.size_bytes, a.env_name) for a in r.attachments]
    assert got == [
        ("bound", "node-2", "slow", "ext4", 64 * MIB, "bound"),
        ("classy", "", "fast-pool", "qcow2", 64 * MIB, "classy"),
        ("plain", "", "", "ext4", 64 * MIB, "plain"),
        # Not made yet: from the template; a class with two backends decides nothing.
        ("data-web-1", "", "gpu", "ext4", 8 * MIB, "data"),
    ]
    assert (r.attachments[0].mount_path, r.attachments[0].read_only) == ("/b", True)
    vm = workload(WorkloadKind.VM, volumes=[VolumeMount(volume="plain")])
    assert volume_plan.resolve(inst(), vm, vols, classes).attachments[0].backend == "qcow2"


@pytest.mark.parametrize(
    ("vols", "why"),
    [
        ({}, "volume data-1 does not exist"),
        ({"state": VolumeState.DELETING}, "volume data-1 is being deleted"),
        (
            {"state": VolumeState.FAILED, "message": "mkfs: no space"},
            "volume data-1 failed: mkfs: no space",
        ),
        ({"state": VolumeState.LOST, "node": "node-2"}, "volume data-1 is lost with node node-2"),
        ({"state": VolumeState.PENDING}, ""),
        ({"state": VolumeState.AVAILABLE, "node": "node-2"}, ""),
        ({"state": VolumeState.RELEASED, "node": "node-2"}, ""),
    ],
)
def test_an_instance_waits_while_its_volume_cannot_be_used(
    vols: dict[str, Any] | None, why: str
) -> None:
    w = workload(volumes=[VolumeMount(volume="data-1")])
    table = {"data-1": volume(**vols)} if vols else {}
    r = volume_plan.resolve(inst(), w, table, {})
    assert (r.wait, len(r.attachments)) == (why, 0 if why else 1)
    assert r.names == ("data-1",)


def test_a_template_volume_of_another_owner_is_not_taken() -> None:
    w = workload(volume_template=VolumeTemplate(name="data", size_bytes=MIB))
    mine = volume("data-web-0", workload="web")
    theirs = volume("data-web-0")
    assert volume_plan.resolve(inst(), w, {"data-web-0": mine}, {}).wait == ""
    assert volume_plan.resolve(inst(), w, {"data-web-0": theirs}, {}).wait == (
        "volume data-web-0 exists and was made by a user, not by this workload"
    )


def test_binding_binds_unbound_volumes_makes_template_ones_and_takes_released_back() -> None:
    t = VolumeTemplate(name="data", size_bytes=8 * MIB, class_name="any")
    w = workload(
        volumes=[VolumeMount(volume="free"), VolumeMount(volume="there")], volume_template=t
    )
    vols = {
        "free": volume("free"),
        "there": volume("there", node="node-1", pool="p", backend="ext4"),
    }
    node = Node(name="node-1", pool="p")
    i = inst(ordinal=3)
    atts = volume_plan.resolve(i, w, vols, {}).attachments
    out = volume_plan.bind_volumes(i, w, atts, node, "node-1", vols)
    assert out is not None
    got = {v.name: (v.node, v.pool, v.backend, v.workload, v.ordinal, v.state) for v in out}
    assert got == {
        "free": ("node-1", "p", "ext4", "", 0, VolumeState.PENDING),
        "data-web-3": ("node-1", "p", "ext4", "web", 3, VolumeState.PENDING),
    }
    made = next(v for v in out if v.name == "data-web-3")
    assert (made.spec.size_bytes, made.spec.class_name, made.created_by) == (
        8 * MIB,
        "any",
        "controller",
    )
    # The workload deleted (its volume RELEASED) and made again: the replica takes it back.
    for owner in ("web", ""):  # whether the release kept the workload's name or not
        released = made.model_copy(update={"state": VolumeState.RELEASED, "workload": owner})
        vols = {v.name: v for v in out} | {"there": vols["there"], "data-web-3": released}
        atts = volume_plan.resolve(i, w, vols, {}).attachments
        (back,) = volume_plan.bind_volumes(i, w, atts, node, "node-1", vols) or []
        assert (back.name, back.state, back.workload) == (
            "data-web-3",
            VolumeState.AVAILABLE,
            "web",
        )
    atts = volume_plan.resolve(i, w, vols, {}).attachments
    assert [a.node for a in atts] == ["node-1", "node-1", "node-1"]
    (back,) = volume_plan.bind_volumes(i, w, atts, node, "node-1", vols) or []
    assert (back.name, back.state, back.workload) == ("data-web-3", VolumeState.AVAILABLE, "web")
    # Bound elsewhere meanwhile: no binding at all.
    assert volume_plan.bind_volumes(i, w, atts, None, "node-2", vols) is None


def test_a_qcow2_disk_held_by_another_live_instance_makes_the_next_wait() -> None:
    w = workload(WorkloadKind.VM, volumes=[VolumeMount(volume="disk")])
    vols = {"disk": volume("disk", node="node-1", backend="qcow2")}
    me = inst("web-b")
    atts = volume_plan.resolve(me, w, vols, {}).attachments
    running = inst("web-a", node="node-1", phase=InstancePhase.RUNNING)
    uses = {"web-a": ("disk",)}
    assert volume_plan.single_user_busy(me, atts, vols, [running, me], uses) == (
        "volume disk is in use by web-a"
    )
    gone = running.model_copy(update={"phase": InstancePhase.STOPPED})
    assert volume_plan.single_user_busy(me, atts, vols, [gone, me], uses) == ""
    # An ext4 volume is shared on its node.
    shared = {"disk": volume("disk", node="node-1", backend="ext4")}
    atts = volume_plan.resolve(me, workload(volumes=[VolumeMount(volume="disk")]), shared, {})
    assert volume_plan.single_user_busy(me, atts.attachments, shared, [running], uses) == ""
