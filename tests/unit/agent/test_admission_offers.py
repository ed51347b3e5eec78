"""The agent's answer to each offer, whatever the scheduler believes: the files a spec opens on
the node and the refusal naming the allowed paths, offers for what already runs or is already
reserved here, an assignment that does not parse, the hold an accepted offer reserves for, and
the held room an instance gives back when the runner forgets it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from google.rpc import code_pb2

from orka.agent.admission import (
    DEFAULT_HOLD_SECONDS,
    Admission,
    Reservation,
    Reservations,
    node_files,
)
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.models import Resources, VmSpec, WorkloadKind, WorkloadSpec
from orka.rpc import convert
from tests.unit.agent.test_admission import MI, TCP, _Admits, _Running, admission, spec


def vm(image: str, kernel: str = "", initrd: str = "") -> WorkloadSpec:
    return WorkloadSpec(
        name="vm",
        kind=WorkloadKind.VM,
        image=image,
        vm=VmSpec(kernel=kernel, initrd=initrd),
        resources=Resources(cpu_millis=100, memory_bytes=64 * MI),
    )


def test_a_vm_opens_its_disk_kernel_and_initrd() -> None:
    assert node_files(vm("/img/disk.qcow2", "/img/vmlinuz", "/img/initrd.gz")) == [
        ("spec.image", "/img/disk.qcow2"),
        ("spec.vm.kernel", "/img/vmlinuz"),
        ("spec.vm.initrd", "/img/initrd.gz"),
    ]
    assert node_files(vm("/img/disk.qcow2", initrd="/img/initrd.gz")) == [
        ("spec.image", "/img/disk.qcow2"),
        ("spec.vm.initrd", "/img/initrd.gz"),
    ]


def built(roots: list[Path], driver: str = "libvirt", send: Any = None, **node: str) -> Admission:
    """An admission with room to spare, `driver` healthy, and the given allowed paths."""
    return Admission(
        capacity=Resources(cpu_millis=4000, memory_bytes=4096 * MI),
        allowed_paths=roots,
        healthy={driver: _Admits()},  # type: ignore[dict-item]
        instances={},
        shutting_down=lambda: False,
        send=send or (lambda m: None),
        **node,
    )


def refusal_with_roots(roots: list[Path], offered: WorkloadSpec) -> str | None:
    return built(roots).admit("vm-0", offered)


def test_a_file_outside_names_the_field_the_path_and_every_allowed_root(tmp_path: Path) -> None:
    roots = [tmp_path / "images", tmp_path / "kernels"]
    for root in roots:
        root.mkdir()
    assert refusal_with_roots(roots, vm("/etc/shadow")) == (
        f"spec.image: '/etc/shadow' is outside the paths this node allows"
        f" ({roots[0]}, {roots[1]}; agent flag --allowed-paths)"
    )
    assert refusal_with_roots([], vm("/etc/shadow")) == (
        "spec.image: '/etc/shadow' is outside the paths this node allows"
        " (none; agent flag --allowed-paths)"
    )


def test_a_long_path_is_cut_in_the_refusal(tmp_path: Path) -> None:
    long = "/" + "d" * 700
    refusal = refusal_with_roots([], vm("/img/disk.qcow2", kernel=long))
    assert refusal is not None
    assert refusal.startswith("spec.image: '/img/disk.qcow2' is outside")
    allowed = built([Path("/img")])
    assert allowed.admit("vm-0", vm("/img/disk.qcow2", kernel=long)) == (
        f"spec.vm.kernel: '{long[:512]}'... is outside the paths this node allows"
        " (/img; agent flag --allowed-paths)"
    )


def offer(
    a: Admission, sent: list[apb.AgentMessage], instance: str, offered: Any, hold: float = 30
) -> Any:
    assignment = apb.Assignment(instance=instance)
    assignment.spec.CopyFrom(
        offered if isinstance(offered, pb.WorkloadSpec) else convert.spec_to_pb(offered)
    )
    a.on_offer(apb.Offer(offer_id=f"o-{instance}", assignment=assignment, hold_seconds=hold))
    reply = sent[-1].offer_reply
    assert reply.offer_id == f"o-{instance}"
    return reply.status


def test_an_offer_for_what_already_runs_here_is_accepted_and_reserves_nothing(
    tmp_path: Path,
) -> None:
    sent: list[apb.AgentMessage] = []
    running = spec((8080, TCP))
    a = admission(tmp_path, {"web-0": _Running(running)}, sent)
    # Its own port and room are its own: no refusal, and no second hold on them.
    assert offer(a, sent, "web-0", running).code == code_pb2.OK
    assert "web-0" not in a.reservations
    assert a.allocated() == Resources(cpu_millis=100, memory_bytes=16 * MI)


def test_an_offer_made_again_is_weighed_without_its_own_reservation(tmp_path: Path) -> None:
    sent: list[apb.AgentMessage] = []
    a = admission(tmp_path, {}, sent)
    big = spec((8080, TCP)).model_copy(
        update={"resources": Resources(cpu_millis=3000, memory_bytes=16 * MI)}
    )
    assert offer(a, sent, "web-0", big).code == code_pb2.OK
    # The scheduler asks again (its reply was lost): the first hold is its own, not in the way.
    assert offer(a, sent, "web-0", big).code == code_pb2.OK
    assert a.allocated().cpu_millis == 3000
    # Another instance would not fit beside it.
    refused = offer(a, sent, "web-1", big.model_copy(update={"ports": []}))
    assert refused.code == code_pb2.FAILED_PRECONDITION


def test_an_assignment_that_does_not_parse_is_refused_as_invalid(tmp_path: Path) -> None:
    sent: list[apb.AgentMessage] = []
    a = admission(tmp_path, {}, sent)
    bad = pb.WorkloadSpec(name="Not A Name", kind=pb.WorkloadSpec.PROCESS, command=["x"])
    status = offer(a, sent, "web-0", bad)
    assert status.code == code_pb2.INVALID_ARGUMENT
    assert status.message.startswith("invalid assignment: ")
    assert "name" in status.message.removeprefix("invalid assignment: ")
    assert a.reservations == {}


@pytest.mark.parametrize(("hold", "held"), [(5.0, 5.0), (0.0, DEFAULT_HOLD_SECONDS)])
def test_an_accepted_offer_is_held_for_the_time_the_scheduler_names(
    tmp_path: Path, hold: float, held: float
) -> None:
    sent: list[apb.AgentMessage] = []
    a = admission(tmp_path, {}, sent)
    before = time.monotonic()
    assert offer(a, sent, "web-0", spec(), hold=hold).code == code_pb2.OK
    after = time.monotonic()
    assert before + held <= a.reservations["web-0"].deadline <= after + held


def test_an_instance_forgotten_gives_back_what_it_held(tmp_path: Path) -> None:
    instances: dict[str, Any] = {"web-0": _Running(spec()), "web-1": _Running(spec())}
    a = admission(tmp_path, instances)
    assert a.allocated().cpu_millis == 200
    del instances["web-0"]
    a.forget("web-0")
    assert a.allocated() == Resources(cpu_millis=100, memory_bytes=16 * MI)


def test_an_admission_told_its_node_refuses_volumes_bound_elsewhere(tmp_path: Path) -> None:
    def answer(node: str) -> str:
        sent: list[apb.AgentMessage] = []
        a = built([tmp_path], "process", sent.append, **({"node": node} if node else {}))
        volume = apb.VolumeAttachment(name="data-1", size_bytes=MI, backend="ext4", node="n2")
        assignment = apb.Assignment(
            instance="web-0", spec=convert.spec_to_pb(spec()), volumes=[volume]
        )
        a.on_offer(apb.Offer(offer_id="o1", assignment=assignment))
        return sent[-1].offer_reply.status.message

    assert answer("n1") == "volume data-1 lives on n2"
    assert answer("n2") == ""
    assert answer("") == ""  # a node that does not know its name cannot tell


def test_popping_a_reservation_not_there_names_it() -> None:
    held = Reservations()
    held["web-0"] = Reservation(Resources(cpu_millis=100), 1.0)
    assert held.pop("web-9", None) is None
    with pytest.raises(KeyError) as info:
        held.pop("web-9")
    assert info.value.args == ("web-9",)
    assert held.pop("web-0") == Reservation(Resources(cpu_millis=100), 1.0)
    assert (held.cpu_millis, held.memory_bytes) == (0, 0)


def test_clearing_the_reservations_clears_their_sums() -> None:
    held = Reservations()
    held["web-0"] = Reservation(Resources(cpu_millis=100, memory_bytes=MI), 1.0)
    held["web-1"] = Reservation(Resources(cpu_millis=200, memory_bytes=MI), 1.0)
    held.clear()
    assert (dict(held), held.cpu_millis, held.memory_bytes) == ({}, 0, 0)
