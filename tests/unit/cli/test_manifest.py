from __future__ import annotations

from pathlib import Path

import pytest

from orka.cli.manifest import load_manifests, parse_manifests
from orka.errors import Invalid
from orka.models import PortProtocol, RestartPolicy, WorkloadKind

FLAT = """
name: web
kind: process
command: ["python3", "-m", "http.server", "8080"]
replicas: 3
resources: {cpu: 500m, memory: 256Mi}
env: {GREETING: hello, PORT: 8080}
nodeSelector: {zone: a}
restartPolicy: OnFailure
maxPerNode: 1
"""

WRAPPED = """
apiVersion: orka/v1
kind: Workload
metadata: {name: db}
spec:
  kind: CONTAINER
  image: postgres:16
  restart_policy: NEVER
  resources: {cpu: 2, memory: 1Gi}
"""


def test_flat_form() -> None:
    [spec] = parse_manifests(FLAT, "f.yaml")
    assert spec.name == "web"
    assert spec.kind is WorkloadKind.PROCESS
    assert spec.replicas == 3
    assert spec.resources.cpu_millis == 500
    assert spec.resources.memory_bytes == 256 * 2**20
    assert spec.env == {"GREETING": "hello", "PORT": "8080"}
    assert spec.node_selector == {"zone": "a"}
    assert spec.restart_policy is RestartPolicy.ON_FAILURE
    assert spec.max_per_node == 1


def test_secret_env_values_are_strings_like_env() -> None:
    [spec] = parse_manifests(
        "name: db\nkind: process\ncommand: [x]\nsecretEnv: {PASSWORD: hunter2, PIN: 1234}\n"
    )
    assert spec.secret_env == {"PASSWORD": "hunter2", "PIN": "1234"}
    [spec] = parse_manifests(
        "name: db\nkind: process\ncommand: [x]\nsecretEnvFiles: {TOKEN: /etc/orka/secrets/t}\n"
    )
    assert spec.secret_env_files == {"TOKEN": "/etc/orka/secrets/t"}


def test_wrapper_form() -> None:
    [spec] = parse_manifests(WRAPPED, "f.yaml")
    assert spec.name == "db"
    assert spec.kind is WorkloadKind.CONTAINER
    assert spec.restart_policy is RestartPolicy.NEVER
    assert spec.resources.cpu_millis == 2000


def test_multi_document() -> None:
    specs = parse_manifests(f"---\n{FLAT}\n---\n{WRAPPED}\n---\n", "f.yaml")
    assert [s.name for s in specs] == ["web", "db"]


def test_command_string_is_split() -> None:
    [spec] = parse_manifests("name: a\nkind: process\ncommand: sleep 'a b'\n")
    assert spec.command == ["sleep", "a b"]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30s", 30.0), ("1m30s", 90.0), ("500ms", 0.5), ("0.500s", 0.5), ("0s", 0.0), ("1h", 3600.0)],
)
def test_stop_grace_period_is_a_duration(value: str, seconds: float) -> None:
    (spec,) = parse_manifests(f"name: a\nkind: process\ncommand: [x]\nstopGracePeriod: {value}\n")
    assert spec.stop_grace_seconds == seconds


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: a\nkind: process\ncommand: [x]\nreplica: 2\n",
            r"document 1: unknown key 'replica'",
        ),
        ("name: a\nkind: banana\ncommand: [x]\n", r"kind: 'banana' is not one of process"),
        ("name: a\nkind: process\ncommand: [x]\nreplicas: -1\n", r"replicas: .*greater than"),
        ("name: a\ncommand: [x]\n", r"kind: is required"),
        ("name: a\nkind: process\n", r"command is required"),
        ("name: A_B\nkind: process\ncommand: [x]\n", r"name"),
        ("name: a\nkind: process\ncommand: [x]\nresources: {cpu: lots}\n", r"resources\.cpu"),
        ("name: a\nkind: process\ncommand: [x]\nresources: {gpu: 1}\n", r"unknown key 'gpu'"),
        ("- a\n- b\n", r"expected a mapping"),
        ("kind: Workload\nmetadata: {name: a}\nspecs: {}\n", r"unknown key 'specs'"),
        ("a: [\n", r"not valid YAML"),
        (
            "name: a\nkind: process\ncommand: [x]\nstop_grace_period: 10\n",
            r"stop_grace_period: 10 is not a duration \(use e\.g\. 10s",
        ),
        (
            "name: a\nkind: process\ncommand: [x]\nstop_grace_period: 2h\n",
            r"stop_grace_period: must be at most 3600s",
        ),
        (
            "name: a\nkind: process\ncommand: [x]\nstop_grace_seconds: 5\n",
            r"unknown key 'stop_grace_seconds'.*stop_grace_period",
        ),
        ("", r"no workloads found"),
        (
            "name: a\nkind: container\nimage: b\nports: [{name: h, port: 1}, {name: h, port: 2}]\n",
            r"ports\[1\]\.name: 'h' is given twice",
        ),
        (
            "name: a\nkind: container\nimage: b\nports: [{name: h, port: 1, proto: tcp}]\n",
            r"ports\[0\]: unknown key 'proto'",
        ),
        (
            "name: a\nkind: process\ncommand: [x]\nports: [{name: h, port: 80}]\n",
            r"ports\[0\]\.port: a host-network process listens on its host port",
        ),
    ],
)
def test_errors_name_the_problem(text: str, expected: str) -> None:
    with pytest.raises(Invalid, match=expected) as info:
        parse_manifests(text, "bad.yaml")
    assert "bad.yaml" in info.value.message


def test_ports_take_either_key_case_and_any_protocol_case() -> None:
    (spec,) = parse_manifests(
        "name: web\nkind: container\nimage: b\nports:\n"
        "  - {name: http, port: 8080, hostPort: 8080}\n"
        "  - {name: dns, port: 53, host_port: 0, protocol: UDP}\n"
    )
    assert [(p.name, p.port, p.host_port, p.protocol.value) for p in spec.ports] == [
        ("http", 8080, 8080, "tcp"),
        ("dns", 53, 0, "udp"),
    ]
    assert spec.fixed_host_ports == {(8080, PortProtocol.TCP)}


def test_error_names_document_index() -> None:
    text = f"{FLAT}\n---\nname: b\nkind: process\ncommand: [x]\nbogus: 1\n"
    with pytest.raises(Invalid, match=r"bad\.yaml: document 2: unknown key 'bogus'"):
        parse_manifests(text, "bad.yaml")


def test_duplicate_names_rejected() -> None:
    with pytest.raises(Invalid, match="already defined"):
        parse_manifests(f"{FLAT}\n---\n{FLAT}", "f.yaml")


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml")), ids=str
)
def test_every_example_manifest_loads(path: Path) -> None:
    # The README points new users at examples/: a renamed field must not leave them broken.
    specs = load_manifests(str(path))
    assert specs and all(s.name for s in specs)
