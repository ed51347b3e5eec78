"""The agent's network flags (also ORKA_*), and what the containerd driver admits with or
without a usable network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orka.cli.defaults import UsageError
from orka.cli.main import build_parser
from orka.cli.services import _network_options
from orka.models import PortSpec, WorkloadKind, WorkloadSpec
from orka.runtime.containerd import ContainerdDriver
from orka.runtime.network import DEFAULT_BIN_DIRS

ENV = ("ORKA_NETWORK_BRIDGE", "ORKA_NETWORK_SUBNET", "ORKA_NETWORK_MASQUERADE", "ORKA_CNI_BIN_DIR")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def options(*argv: str) -> dict[str, Any]:
    return _network_options(build_parser().parse_args(["agent", *argv]))


def test_defaults_leave_bridge_and_subnet_to_the_network() -> None:
    assert options() == {"network_bridge": "", "network_subnet": "", "network_masquerade": False}


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    got = options(
        "--network-bridge",
        "orka0",
        "--network-subnet",
        "10.70.0.0/24",
        "--network-masquerade",
        "--cni-bin-dir",
        "/opt/cni/bin,/usr/lib/cni",
    )
    assert got == {
        "network_bridge": "orka0",
        "network_subnet": "10.70.0.0/24",
        "network_masquerade": True,
        "cni_bin_dirs": [Path("/opt/cni/bin"), Path("/usr/lib/cni")],
    }
    monkeypatch.setenv("ORKA_NETWORK_BRIDGE", "orka1")
    monkeypatch.setenv("ORKA_NETWORK_MASQUERADE", "1")
    got = options()
    assert (got["network_bridge"], got["network_masquerade"]) == ("orka1", True)
    assert options("--network-bridge", "orka2")["network_bridge"] == "orka2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--network-bridge", "much-too-long-name"], "--network-bridge: 'much-too-long-name'"),
        (["--network-subnet", "10.70.0.1/24"], "--network-subnet: '10.70.0.1/24'"),
        (["--network-subnet", "fd00::/64"], "must be an IPv4 subnet"),
        (["--cni-bin-dir", "relative/bin"], "--cni-bin-dir: 'relative/bin' must be an absolute"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        options(*argv)


def test_agent_config_defaults_to_the_usual_plugin_dirs() -> None:
    from orka.agent.service import AgentConfig

    config = AgentConfig(name="n", schedulers=["h:1"], data_dir=Path("/tmp/x"))
    assert (
        config.cni_bin_dirs
        == list(DEFAULT_BIN_DIRS)
        == [Path("/usr/lib/cni"), Path("/opt/cni/bin")]
    )
    assert (config.network_bridge, config.network_subnet, config.network_masquerade) == (
        "",
        "",
        False,
    )


class _Net:
    """A stand-in network: only whether it can attach matters to admission."""

    def __init__(self, problem: str | None) -> None:
        self.problem = problem

    def unavailable(self) -> str | None:
        return self.problem


def spec(ports: list[PortSpec]) -> WorkloadSpec:
    return WorkloadSpec(name="w", kind=WorkloadKind.CONTAINER, image="busybox", ports=ports)


@pytest.mark.parametrize(
    ("network", "ports", "reason"),
    [
        (None, [], None),
        (
            None,
            [PortSpec(name="http", port=80)],
            "ports: needs the node's instance network, and this node has none",
        ),
        (_Net(None), [PortSpec(name="http", port=80)], None),
        (_Net("not root"), [], None),  # runs loopback-only, with a warning
        (
            _Net("not root"),
            [PortSpec(name="http", port=80)],
            "ports: needs the node's instance network: not root",
        ),
    ],
)
def test_containerd_admits_ports_only_with_a_usable_network(
    tmp_path: Path, network: Any, ports: list[PortSpec], reason: str | None
) -> None:
    driver = ContainerdDriver(tmp_path, network=network)
    assert driver.admit(spec(ports)) == reason


def test_the_agent_hands_the_network_to_the_drivers_that_take_one() -> None:
    from orka.runtime.registry import takes

    assert takes("containerd", "network") and takes("process", "network")
    assert takes("libvirt", "network")
    assert not takes("fake", "network") and not takes("nope", "network")
