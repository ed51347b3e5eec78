"""WorkloadSpec validation: every bad field is refused, and the error names it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from orka.models import MAX_REPLICAS, Instance, InstancePhase, Resources, WorkloadSpec
from tests.subprocs import fresh_python


def spec(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"name": "web", "kind": "PROCESS", "command": ["sleep", "1"]}
    data.update(overrides)
    return data


VALID = [
    spec(),
    spec(name="a"),
    spec(name="a" * 63),
    spec(name="web-1-x"),
    spec(replicas=0),
    spec(replicas=MAX_REPLICAS),
    spec(kind="CONTAINER", command=[], image="nginx"),
    spec(kind="VM", command=[], image="/img/disk.qcow2"),
    spec(kind="VM", command=[], vm={"kernel": "/boot/vmlinuz"}),
    spec(env={"PATH": "/bin", "A_B": ""}),
    spec(node_selector={"zone": "a", "orka.io/role": "gpu", "k8s.io/x-y_z": "1"}),
    spec(stop_grace_seconds=0),
    spec(stop_grace_seconds=3600),
    spec(resources={"cpu_millis": 0, "memory_bytes": 0}),
    spec(ports=[{"name": "http"}, {"name": "dns", "host_port": 53, "protocol": "udp"}]),
    spec(ports=[{"name": "http", "port": 8080, "host_port": 8080}]),
    spec(ports=[{"name": "a", "host_port": 53}, {"name": "b", "host_port": 53, "protocol": "udp"}]),
    spec(network="bridge", ports=[{"name": "http", "port": 8080}]),
    spec(kind="CONTAINER", command=[], image="x", ports=[{"name": "a-b", "port": 1}]),
    spec(kind="CONTAINER", command=[], image="x", network="bridge"),
    spec(ports=[{"name": f"p{i}"} for i in range(32)]),
]


@pytest.mark.parametrize("data", VALID)
def test_valid_specs_are_accepted(data: dict[str, Any]) -> None:
    s = WorkloadSpec.model_validate(data)
    assert s.name == data["name"]
    # A spec survives a JSON round trip (how the store keeps it).
    assert WorkloadSpec.model_validate_json(s.model_dump_json()) == s


INVALID = [
    ("missing name", {k: v for k, v in spec().items() if k != "name"}, "name", "required"),
    ("empty name", spec(name=""), "name", "name is required"),
    ("uppercase name", spec(name="Web"), "name", "lowercase"),
    ("too long", spec(name="a" * 64), "name", "1-63"),
    ("leading dash", spec(name="-web"), "name", "lowercase"),
    ("trailing dash", spec(name="web-"), "name", "lowercase"),
    ("underscore", spec(name="my_web"), "name", "lowercase"),
    ("dot", spec(name="my.web"), "name", "lowercase"),
    ("missing kind", {"name": "web", "command": ["x"]}, "kind", "required"),
    ("bad kind", spec(kind="POD"), "kind", "PROCESS"),
    ("negative replicas", spec(replicas=-1), "replicas", "greater than or equal to 0"),
    ("too many replicas", spec(replicas=MAX_REPLICAS + 1), "replicas", "less than or equal"),
    ("negative cpu", spec(resources={"cpu_millis": -1}), "resources.cpu_millis", ">= 0"),
    ("negative memory", spec(resources={"memory_bytes": -5}), "resources.memory_bytes", ">= 0"),
    ("process without command", spec(command=[]), "", "command is required"),
    ("container without image", spec(kind="CONTAINER"), "", "image is required"),
    ("vm without image", spec(kind="VM"), "", "image or vm.kernel"),
    ("vm with empty kernel", spec(kind="VM", vm={"initrd": "/x"}), "", "image or vm.kernel"),
    ("empty env key", spec(env={"": "x"}), "env..[key]", "non-empty"),
    ("env key with =", spec(env={"A=B": "x"}), "env.A=B.[key]", "without '='"),
    ("env key with NUL", spec(env={"A\0": "x"}), "env.A\0.[key]", "NUL"),
    (
        "selector key with space",
        spec(node_selector={"a b": "x"}),
        "node_selector.a b.[key]",
        "label key",
    ),
    ("empty selector key", spec(node_selector={"": "x"}), "node_selector..[key]", "label key"),
    (
        "selector key leading dot",
        spec(node_selector={".a": "x"}),
        "node_selector..a.[key]",
        "label key",
    ),
    (
        "selector key too long",
        spec(node_selector={"a" * 254: "x"}),
        f"node_selector.{'a' * 254}.[key]",
        "over the limit of 253",
    ),
    ("negative grace", spec(stop_grace_seconds=-0.1), "stop_grace_seconds", "greater than"),
    ("grace too long", spec(stop_grace_seconds=3601), "stop_grace_seconds", "less than"),
    ("negative max_per_node", spec(max_per_node=-1), "max_per_node", "greater than"),
    ("unknown field", spec(color="red"), "color", "not permitted"),
    ("bad restart policy", spec(restart_policy="SOMETIMES"), "restart_policy", "ALWAYS"),
    (
        "duplicate port name",
        spec(ports=[{"name": "a", "host_port": 1}, {"name": "a", "host_port": 2}]),
        "ports",
        "[1].name: 'a' is given twice",
    ),
    (
        "same fixed host port twice",
        spec(ports=[{"name": "a", "host_port": 80}, {"name": "b", "host_port": 80}]),
        "ports",
        "[1].host_port: 80/tcp is given twice",
    ),
    ("port 0", spec(ports=[{"name": "a", "port": 0}]), "ports.0.port", "greater than or equal"),
    ("port 65536", spec(ports=[{"name": "a", "host_port": 65536}]), "ports.0.host_port", "less"),
    ("port name too long", spec(ports=[{"name": "a" * 16}]), "ports.0.name", "at most 15"),
    ("port name case", spec(ports=[{"name": "Http"}]), "ports.0.name", "lowercase"),
    ("sctp", spec(ports=[{"name": "a", "protocol": "sctp"}]), "ports.0.protocol", "'tcp'"),
    ("33 ports", spec(ports=[{"name": f"p{i}"} for i in range(33)]), "ports", "at most 32"),
    (
        "host process with its own port",
        spec(ports=[{"name": "a", "port": 80}]),
        "",
        "ports[0].port: a host-network process listens on its host port",
    ),
    (
        "container port missing",
        spec(kind="CONTAINER", command=[], image="x", ports=[{"name": "a", "host_port": 80}]),
        "",
        "ports[0].port: required where an instance has a network of its own",
    ),
    (
        "bridge process port missing",
        spec(network="bridge", ports=[{"name": "a"}]),
        "",
        "ports[0].port: required",
    ),
    (
        "container on the host network",
        spec(kind="CONTAINER", command=[], image="x", network="host"),
        "",
        "network: host is for PROCESS workloads only",
    ),
    ("unknown network", spec(network="overlay"), "network", "'host' or 'bridge'"),
]


@pytest.mark.parametrize(
    ("data", "loc", "fragment"),
    [pytest.param(d, loc, frag, id=case) for case, d, loc, frag in INVALID],
)
def test_invalid_specs_name_the_field(data: dict[str, Any], loc: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        WorkloadSpec.model_validate(data)
    errors = info.value.errors()
    assert len(errors) == 1
    assert ".".join(str(p) for p in errors[0]["loc"]) == loc
    assert fragment.replace(">= 0", "greater than or equal to 0") in errors[0]["msg"]


def test_spec_is_frozen() -> None:
    s = WorkloadSpec.model_validate(spec())
    with pytest.raises(ValidationError):
        s.replicas = 3  # type: ignore[misc]


def test_driver_follows_kind() -> None:
    drivers = {
        k: WorkloadSpec.model_validate(spec(kind=k, image="/i")).driver
        for k in ("PROCESS", "CONTAINER", "VM")
    }
    assert drivers == {"PROCESS": "process", "CONTAINER": "containerd", "VM": "libvirt"}


@pytest.mark.parametrize(
    ("a", "b", "fits"),
    [
        ((1, 1), (1, 1), True),
        ((2, 1), (1, 5), False),
        ((1, 2), (5, 1), False),
        ((0, 0), (0, 0), True),
    ],
)
def test_resources_fits_in(a: tuple[int, int], b: tuple[int, int], fits: bool) -> None:
    ra = Resources(cpu_millis=a[0], memory_bytes=a[1])
    rb = Resources(cpu_millis=b[0], memory_bytes=b[1])
    assert ra.fits_in(rb) is fits
    assert (ra + rb) - rb == ra


@pytest.mark.parametrize(
    ("phase", "terminal"),
    [(p, p.value in {"SUCCEEDED", "FAILED", "STOPPED", "LOST"}) for p in InstancePhase],
)
def test_instance_terminal(phase: InstancePhase, terminal: bool) -> None:
    assert Instance(name="i", workload="w", phase=phase).terminal is terminal


def test_a_spec_never_shows_its_secret_values_in_a_repr_or_a_traceback() -> None:
    """Tracebacks quote specs (pydantic's input_value, log.exception of a failed start)."""
    from orka.runtime.base import RunSpec

    spec = WorkloadSpec(
        name="db", kind="PROCESS", command=["x"], env={"A": "plain"}, secret_env={"K": "hunter2"}
    )
    assert "hunter2" not in repr(spec) and "hunter2" not in str(spec)
    assert "plain" in repr(spec)  # only the secrets are left out
    assert spec.environment == {"A": "plain", "K": "hunter2"}
    broken = spec.model_copy(update={"command": []})  # not validated until RunSpec does
    with pytest.raises(ValidationError) as info:
        RunSpec(instance="db-1", workload="db", spec=broken)
    assert "input_value=WorkloadSpec(name='db'" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_models_build_their_validators_on_first_use_and_validate_then() -> None:
    # A fresh interpreter: this one has used most models already.
    code = (
        "import json, pydantic, orka.models as m\n"
        "models = [v for v in vars(m).values() if isinstance(v, type)"
        " and issubclass(v, m.Model) and v is not m.Model]\n"
        "built = [c.__name__ for c in models if c.__pydantic_complete__]\n"
        "m.Resources(cpu_millis=5)\n"
        "try:\n"
        "    m.Resources(cpu_millis=-1)\n"
        "    refused = ''\n"
        "except pydantic.ValidationError as e:\n"
        "    refused = e.errors()[0]['loc'][0]\n"
        "later = [c.__name__ for c in models if c.__pydantic_complete__]\n"
        "print(json.dumps([len(models), built, later, refused]))\n"
    )
    out = fresh_python(code)
    count, built, later, refused = json.loads(out)
    assert count >= 25
    assert built == []
    assert later == ["Resources"]
    assert refused == "cpu_millis"
