"""The agent's admission of offers: fixed host ports held by what runs and what is reserved."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from google.rpc import code_pb2

from orka.agent.admission import Admission, Reservation
from orka.api import agent_pb2 as apb
from orka.models import (
    InstancePhase,
    PortBinding,
    PortProtocol,
    PortSpec,
    Resources,
    WorkloadKind,
    WorkloadSpec,
)
from orka.rpc import convert

TCP, UDP = PortProtocol.TCP, PortProtocol.UDP
MI = 1 << 20


def spec(*ports: tuple[int, PortProtocol], name: str = "web") -> WorkloadSpec:
    return WorkloadSpec(
        name=name,
        kind=WorkloadKind.PROCESS,
        command=["sleep", "1"],
        resources=Resources(cpu_millis=100, memory_bytes=16 * MI),
        ports=[
            PortSpec(name=f"p{i}", host_port=p, protocol=proto)
            for i, (p, proto) in enumerate(ports)
        ],
    )


@dataclass
class _Running:
    """What admission reads of a supervised instance."""

    spec: WorkloadSpec
    phase: InstancePhase = InstancePhase.RUNNING
    ports: list[PortBinding] = field(default_factory=list)

    @property
    def resources(self) -> Resources:
        return self.spec.resources

    @property
    def holds_resources(self) -> bool:
        return self.phase not in (InstancePhase.STOPPED, InstancePhase.FAILED)


class _Admits:
    def admit(self, spec: WorkloadSpec) -> str | None:
        return None


def admission(
    tmp_path: Path, instances: dict[str, Any], sent: list[Any] | None = None
) -> Admission:
    return Admission(
        capacity=Resources(cpu_millis=4000, memory_bytes=4096 * MI),
        allowed_paths=[tmp_path],
        healthy={"process": _Admits()},  # type: ignore[dict-item]
        instances=instances,
        shutting_down=lambda: False,
        send=(sent if sent is not None else []).append,
    )


SOON = 60.0
CASES: list[
    tuple[str, dict[str, Any], dict[str, tuple[frozenset[Any], float]], WorkloadSpec, str | None]
] = [
    # id, instances, reservations (ports, seconds left), offered spec, refusal
    ("nothing-held", {}, {}, spec((8080, TCP)), None),
    ("no-ports-asked", {"a": _Running(spec((8080, TCP)))}, {}, spec(), None),
    (
        "running-holds",
        {"a": _Running(spec((8080, TCP)))},
        {},
        spec((8080, TCP)),
        "host port 8080 in use",
    ),
    (
        "starting-holds",
        {"a": _Running(spec((8080, TCP)), InstancePhase.STARTING)},
        {},
        spec((8080, TCP)),
        "host port 8080 in use",
    ),
    (
        "stopped-frees",
        {"a": _Running(spec((8080, TCP)), InstancePhase.STOPPED)},
        {},
        spec((8080, TCP)),
        None,
    ),
    ("other-protocol", {"a": _Running(spec((53, UDP)))}, {}, spec((53, TCP)), None),
    ("udp-named", {"a": _Running(spec((53, UDP)))}, {}, spec((53, UDP)), "host port 53/udp in use"),
    # A port the node picked for a running instance (host_port 0 in its spec) is taken too.
    (
        "picked-port-holds",
        {"a": _Running(spec(), ports=[PortBinding(name="p", port=80, host_port=31000)])},
        {},
        spec((31000, TCP)),
        "host port 31000 in use",
    ),
    (
        "reserved-holds",
        {},
        {"b": (frozenset({(8080, TCP)}), SOON)},
        spec((8080, TCP)),
        "host port 8080 in use",
    ),
    # An offer again for an instance already reserved does not collide with itself.
    ("own-reservation", {}, {"web-0": (frozenset({(8080, TCP)}), SOON)}, spec((8080, TCP)), None),
    (
        "expired-reservation-frees",
        {},
        {"b": (frozenset({(8080, TCP)}), -1.0)},
        spec((8080, TCP)),
        None,
    ),
    (
        "lowest-named",
        {"a": _Running(spec((9000, TCP), (443, TCP)))},
        {},
        spec((9000, TCP), (8080, TCP), (443, TCP)),
        "host port 443 in use",
    ),
]


@pytest.mark.parametrize(
    ("instances", "reservations", "offered", "refusal"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_admission_refuses_a_host_port_held_here(
    tmp_path: Path,
    instances: dict[str, Any],
    reservations: dict[str, tuple[frozenset[Any], float]],
    offered: WorkloadSpec,
    refusal: str | None,
) -> None:
    a = admission(tmp_path, instances)
    now = time.monotonic()
    for name, (ports, left) in reservations.items():
        a.reservations[name] = Reservation(Resources(), now + left, ports)
    a.expire()  # as each heartbeat does
    assert a.admit("web-0", offered) == refusal


def test_an_accepted_offer_reserves_its_ports_and_a_release_frees_them(tmp_path: Path) -> None:
    sent: list[apb.AgentMessage] = []
    a = admission(tmp_path, {}, sent)

    def offer(instance: str, offered: WorkloadSpec) -> Any:
        a.on_offer(
            apb.Offer(
                offer_id=instance,
                assignment=apb.Assignment(instance=instance, spec=convert.spec_to_pb(offered)),
                hold_seconds=30,
            )
        )
        return sent[-1].offer_reply.status

    assert offer("web-0", spec((8080, TCP))).code == 0
    assert a.reservations["web-0"].host_ports == {(8080, TCP)}
    refused = offer("web-1", spec((8080, TCP)))
    assert (refused.code, refused.message) == (
        code_pb2.FAILED_PRECONDITION,
        "host port 8080 in use",
    )
    a.release("web-0")
    assert offer("web-1", spec((8080, TCP))).code == 0


@pytest.mark.parametrize(
    ("volume_node", "refusal"),
    [("", None), ("node-1", None), ("node-2", "volume data-1 lives on node-2")],
)
def test_an_offer_with_a_volume_bound_elsewhere_is_refused_and_reserves_nothing(
    tmp_path: Path, volume_node: str, refusal: str | None
) -> None:
    sent: list[apb.AgentMessage] = []
    a = admission(tmp_path, {}, sent)
    a.node = "node-1"
    volume = apb.VolumeAttachment(name="data-1", size_bytes=MI, backend="ext4", node=volume_node)
    a.on_offer(
        apb.Offer(
            offer_id="o1",
            assignment=apb.Assignment(
                instance="web-0", spec=convert.spec_to_pb(spec()), volumes=[volume]
            ),
        )
    )
    status = sent[-1].offer_reply.status
    assert (status.message or None, "web-0" in a.reservations) == (refusal, refusal is None)
    if refusal:
        assert status.code == code_pb2.FAILED_PRECONDITION


def _recount(a: Admission) -> tuple[int, int]:
    """What the node holds, summed afresh from the instances and reservations."""
    held = [i.resources for i in a.instances.values() if i.holds_resources]
    held += [r.resources for r in a.reservations.values()]
    return sum(r.cpu_millis for r in held), sum(r.memory_bytes for r in held)


async def test_the_held_room_follows_the_runner_through_an_instances_life(
    tmp_path: Path,
) -> None:
    """Admission keeps what the node holds as instances come, change and go (not summed per
    offer): after every step of the real runner on the fake driver it equals a recount."""
    import asyncio

    from orka.agent.runner import Runner
    from orka.agent.secret_files import SecretFiles
    from orka.agent.state import StateFile
    from orka.models import RestartPolicy
    from orka.runtime.fake import FakeDriver

    fake = FakeDriver()
    instances: dict[str, Any] = {}
    sent: list[apb.AgentMessage] = []
    a = Admission(
        capacity=Resources(cpu_millis=4000, memory_bytes=4096 * MI),
        allowed_paths=[tmp_path],
        healthy={"fake": fake},
        instances=instances,
        shutting_down=lambda: False,
        send=sent.append,
    )
    state = StateFile(tmp_path / "state.json", delay=0.0)
    acks: list[tuple[str, int]] = []
    runner = Runner(
        node="n1",
        drivers={"fake": fake},
        healthy={"fake": fake},
        state_file=state,
        secret_files=SecretFiles([]),
        admission=a,
        ack=lambda cid, status: acks.append((cid, status.code)),
        on_change=lambda inst: None,
        instances=instances,
    )

    def used() -> tuple[int, int]:
        got = a.allocated()
        return got.cpu_millis, got.memory_bytes

    def assignment(name: str, s: WorkloadSpec) -> apb.Assignment:
        return apb.Assignment(instance=name, generation=1, spec=convert.spec_to_pb(s))

    async def until(cond: Any) -> None:
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition never held")

    short = spec(name="job").model_copy(
        update={"env": {"FAKE_EXIT_AFTER": "0.05"}, "restart_policy": RestartPolicy.NEVER}
    )
    specs = {"web-a": spec(), "web-b": spec(), "job-c": short, "web-d": spec()}
    for i, (name, s) in enumerate(specs.items()):
        a.on_offer(apb.Offer(offer_id=f"o{i}", assignment=assignment(name, s), hold_seconds=30))
    assert used() == _recount(a) == (400, 64 * MI)
    for name in ("web-a", "web-b", "job-c"):
        start = apb.StartInstance(command_id=name, assignment=assignment(name, specs[name]))
        runner.on_start(start)
        assert used() == _recount(a) == (400, 64 * MI)  # the reservation became the instance
    await until(lambda: len(acks) == 3)
    # The job ends on its own and holds nothing any more.
    await until(lambda: instances["job-c"].phase is InstancePhase.SUCCEEDED)
    assert used() == _recount(a) == (300, 48 * MI)
    runner.on_stop(apb.StopInstance(command_id="s1", instance="web-b", remove=True))
    await until(lambda: "web-b" not in instances)
    assert used() == _recount(a) == (200, 32 * MI)
    # A reservation that runs out frees its room.
    a.reservations["web-d"] = Reservation(Resources(cpu_millis=100, memory_bytes=16 * MI), -1.0)
    a.expire()
    assert used() == _recount(a) == (100, 16 * MI)
    await runner.stop_all("test")
    assert used() == _recount(a) == (0, 0)
