"""docker-compose.yml hands each service only its own certs folder (no Docker needed to check)."""

from __future__ import annotations

from pathlib import Path

import yaml

from orka.security.issue import pair_dir

COMPOSE = Path(__file__).resolve().parents[3] / "docker-compose.yml"


def _role_and_name(command: list[str]) -> tuple[str, str]:
    role = command[0]
    name = command[command.index("--name") + 1] if "--name" in command else role
    return role, name


def test_each_service_mounts_only_its_own_certs_folder_read_only() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    checked = set()
    for service, spec in services.items():
        if spec.get("image") != "orka:dev":
            continue  # not an Orka service (etcd): no certs at all
        cert_mounts = [v for v in spec.get("volumes", []) if v.split(":")[1] == "/certs"]
        if service == "certs":
            # Only the one-shot issuer sees the whole dir, CA key included.
            assert cert_mounts == ["./certs:/certs"]
            continue
        role, name = _role_and_name(spec["command"])
        own = pair_dir(Path("./certs"), role, name)
        assert cert_mounts == [f"./{own}:/certs:ro"], service
        checked.add(role)
    assert checked == {"controller", "scheduler", "agent"}


def test_certs_service_issues_every_agent_folder_mounted() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    command = services["certs"]["command"]
    nodes = {command[i + 1] for i, arg in enumerate(command) if arg == "--node"}
    agents = {
        _role_and_name(s["command"])[1]
        for s in services.values()
        if s.get("command", [""])[0] == "agent"
    }
    assert agents == nodes
