"""The instance network's pure parts: configuration it hands the CNI plugins, defaults, records,
and how a plugin is run (with stand-in plugins: small scripts that speak CNI)."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any

import pytest

from orka.errors import Invalid, RuntimeFailure
from orka.models import PortBinding, PortProtocol
from orka.runtime import cni, network
from orka.runtime.base import Attachment

SUBNET = ipaddress.IPv4Network("10.70.3.0/24")


def binding(name: str = "http", port: int = 8080, host: int = 20001, proto: str = "tcp") -> Any:
    return PortBinding(name=name, port=port, host_port=host, protocol=PortProtocol(proto))


def routes(*items: tuple[str, str]) -> list[tuple[str, ipaddress.IPv4Network]]:
    return [(dev, ipaddress.IPv4Network(net)) for dev, net in items]


# -- configuration -------------------------------------------------------------------------


def test_conflist_is_bridge_with_host_local_then_portmap() -> None:
    conf = network.conflist(
        name="orka-br0",
        bridge="br0",
        subnet=SUBNET,
        ipam_dir=Path("/data/ipam"),
        masquerade=False,
        bindings=[binding(), binding("dns", 53, 20002, "udp")],
    )
    assert conf["cniVersion"] == "1.0.0" and conf["name"] == "orka-br0"
    bridge, portmap = conf["plugins"]
    assert bridge["type"] == "bridge" and bridge["bridge"] == "br0"
    assert bridge["isGateway"] is True and bridge["ipMasq"] is False
    assert bridge["ipam"] == {
        "type": "host-local",
        "ranges": [[{"subnet": "10.70.3.0/24", "gateway": "10.70.3.1"}]],
        "dataDir": "/data/ipam",
    }
    assert portmap["type"] == "portmap" and portmap["snat"] is True
    assert portmap["runtimeConfig"]["portMappings"] == [
        {"hostPort": 20001, "containerPort": 8080, "protocol": "tcp"},
        {"hostPort": 20002, "containerPort": 53, "protocol": "udp"},
    ]


@pytest.mark.parametrize(
    ("masquerade", "ports", "plugins"),
    [
        (True, [], ["bridge"]),
        (False, [binding()], ["bridge", "portmap"]),
    ],
)
def test_conflist_masquerade_and_portmap_only_when_asked(
    masquerade: bool, ports: list[PortBinding], plugins: list[str]
) -> None:
    conf = network.conflist(
        name="n",
        bridge="b",
        subnet=SUBNET,
        ipam_dir=Path("/i"),
        masquerade=masquerade,
        bindings=ports,
    )
    assert [p["type"] for p in conf["plugins"]] == plugins
    assert conf["plugins"][0]["ipMasq"] is masquerade


def test_plugin_config_carries_name_version_and_previous_result() -> None:
    conf = {"cniVersion": "1.0.0", "name": "net", "plugins": []}
    prev = {"ips": [{"address": "10.70.3.2/24"}]}
    got = cni.plugin_config(conf, {"type": "portmap", "snat": True}, prev)
    assert got == {
        "cniVersion": "1.0.0",
        "name": "net",
        "type": "portmap",
        "snat": True,
        "prevResult": prev,
    }
    assert "prevResult" not in cni.plugin_config(conf, {"type": "bridge"}, None)


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"ips": [{"address": "10.70.3.9/24", "gateway": "10.70.3.1"}]}, ("10.70.3.9", 24)),
        ({"ips": [{"address": "fd00::2/64"}, {"address": "10.1.2.3/16"}]}, ("10.1.2.3", 16)),
    ],
)
def test_result_address_takes_the_first_ipv4(result: dict[str, Any], expected: Any) -> None:
    assert network.result_address(result) == expected


def test_result_without_ipv4_is_a_failure() -> None:
    with pytest.raises(RuntimeFailure, match="no IPv4 address"):
        network.result_address({"ips": [{"address": "fd00::2/64"}]})


# -- defaults ------------------------------------------------------------------------------


def test_default_bridge_fits_an_interface_name_and_differs_per_agent() -> None:
    a, b = network.default_bridge("node-1@/d1"), network.default_bridge("node-1@/d2")
    assert a.startswith("orka-") and len(a) == 15 and a != b
    assert network.default_bridge("node-1@/d1") == a  # a restart gets the same one
    network.check_bridge(a)


@pytest.mark.parametrize("name", ["", "x" * 16, "a/b", "a b", "a:b"])
def test_bad_bridge_names_are_refused(name: str) -> None:
    with pytest.raises(Invalid, match="--network-bridge"):
        network.check_bridge(name)


def test_default_subnet_is_a_stable_slash_24_of_the_pool() -> None:
    got = network.default_subnet("node-1@/d", [], "br")
    assert got.prefixlen == 24 and got.subnet_of(network.DEFAULT_POOL)
    assert network.default_subnet("node-1@/d", [], "br") == got
    assert network.default_subnet("node-2@/d", [], "br") != got


def test_default_subnet_skips_other_devices_routes_but_not_its_own_bridge() -> None:
    first = network.default_subnet("k", [], "br")
    # Another device routes it: the next /24 along.
    moved = network.default_subnet("k", routes(("eth1", str(first))), "br")
    assert moved != first and not moved.overlaps(first)
    # A wide route over it moves it too; the default route says nothing.
    wide = ipaddress.IPv4Network((int(first.network_address), 16), strict=False)
    assert not network.default_subnet("k", routes(("vpn0", str(wide))), "br").overlaps(wide)
    # Our own bridge's route (an agent restarting) keeps the subnet where it is.
    assert network.default_subnet("k", routes(("br", str(first))), "br") == first


def test_default_subnet_fails_when_every_slash_24_is_routed() -> None:
    pool = ipaddress.IPv4Network("10.9.0.0/23")
    with pytest.raises(RuntimeFailure, match="overlaps a route"):
        network.default_subnet("k", routes(("eth0", "10.9.0.0/22")), "br", pool)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("10.70.3.0/24", True),
        ("10.70.3.1/24", False),  # host bits set
        ("fd00::/64", False),
        ("10.70.3.0/30", False),  # too small for a bridge of instances
        ("nope", False),
    ],
)
def test_parse_subnet(text: str, ok: bool) -> None:
    if ok:
        assert str(network.parse_subnet(text)) == text
    else:
        with pytest.raises(Invalid, match="--network-subnet"):
            network.parse_subnet(text)


def test_host_routes_reads_the_kernels_table(tmp_path: Path) -> None:
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
        "br9\t0000460A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
    )
    assert network.host_routes(table) == routes(("eth0", "192.0.2.0/24"), ("br9", "10.70.0.0/16"))
    assert network.host_routes(tmp_path / "missing") == []


def test_netns_names_are_short_and_per_agent() -> None:
    a = network.netns_name("br1", "web-" + "x" * 200)
    assert len(a) <= 30 and a != network.netns_name("br2", "web-" + "x" * 200)


# -- records -------------------------------------------------------------------------------


def record_data(**over: Any) -> dict[str, Any]:
    data = {
        "attachment": Attachment(
            instance="web-0",
            address="10.70.3.2",
            prefix_len=24,
            gateway="10.70.3.1",
            bridge="br0",
            ports=[binding()],
            netns="/run/netns/x",
        ).model_dump(mode="json"),
        "kind": "netns",
        "netns_name": "x",
        "config": {"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "bridge"}]},
        "result": {"ips": [{"address": "10.70.3.2/24"}]},
    }
    data.update(over)
    return data


def test_record_round_trips() -> None:
    record = network._Record.parse(record_data())
    assert record.attachment.ports == [binding()]
    assert network._Record.parse(json.loads(json.dumps(record.dump()))) == record


def fake_network(tmp_path: Path, bin_dir: Path | None = None) -> network.CniNetwork:
    return network.CniNetwork(
        tmp_path / "net",
        node="n1",
        bridge="orkatest0",
        subnet="10.70.3.0/24",
        bin_dirs=[bin_dir or tmp_path / "nobin"],
    )


def test_records_of_an_earlier_process_are_adopted_and_bad_ones_skipped(tmp_path: Path) -> None:
    records = tmp_path / "net" / "attachments"
    records.mkdir(parents=True)
    (records / "web-0.json").write_text(json.dumps(record_data()))
    (records / "broken.json").write_text("{not json")
    (records / "partial.json").write_text(json.dumps({"kind": "netns"}))
    net = fake_network(tmp_path)
    got = net.attachment("web-0")
    assert got is not None and got.address == "10.70.3.2" and got.ports == [binding()]
    assert net.instances() == ["web-0"]
    # The adopted host port is the instance's: nobody else is given it.
    assert net._ports.bindings("web-0") == [binding()]


def test_missing_plugins_make_it_unavailable_with_a_reason(tmp_path: Path) -> None:
    net = fake_network(tmp_path)
    reason = net.unavailable()
    assert reason is not None
    if os.geteuid() == 0:
        assert "bridge" in reason and "containernetworking-plugins" in reason


async def test_attach_when_unavailable_names_why(tmp_path: Path) -> None:
    net = fake_network(tmp_path)
    with pytest.raises(RuntimeFailure, match="network: "):
        await net.attach_netns("web-0", [])


async def test_subnet_chosen_once_is_kept_in_the_data_dir(tmp_path: Path) -> None:
    first = network.CniNetwork(tmp_path / "net", node="n1", bin_dirs=[tmp_path])
    (tmp_path / "net" / "subnet").write_text("10.99.1.0/24\n")
    again = network.CniNetwork(tmp_path / "net", node="n1", bin_dirs=[tmp_path])
    assert str(again.subnet) == "10.99.1.0/24" and first.bridge == again.bridge


# -- running a plugin ----------------------------------------------------------------------


def plugin(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


async def run(bin_dir: Path, name: str, command: str = "ADD", timeout: float = 5.0) -> Any:
    return await cni.invoke(
        name,
        command,
        container_id="web-0",
        netns="/run/netns/x",
        ifname="eth0",
        config={"cniVersion": "1.0.0", "name": "n", "type": name},
        bin_dirs=[bin_dir],
        timeout=timeout,
    )


async def test_plugin_gets_the_cni_environment_and_config_on_stdin(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    plugin(
        bins,
        "echo",
        'conf=$(cat); printf \'{"cniVersion":"1.0.0","ips":[{"address":"10.70.3.2/24"}],'
        '"env":"%s %s %s %s %s","conf":%s}\' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_NETNS"'
        ' "$CNI_IFNAME" "$CNI_PATH" "$conf"',
    )
    got = await run(bins, "echo")
    assert got["env"] == f"ADD web-0 /run/netns/x eth0 {bins}"
    assert got["conf"] == {"cniVersion": "1.0.0", "name": "n", "type": "echo"}
    assert await run(bins, "echo", "DEL") is None


async def test_plugin_error_names_the_plugin_and_its_message(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    plugin(
        bins,
        "bad",
        'echo \'{"code":11,"msg":"failed to allocate","details":"range full"}\'; exit 1',
    )
    with pytest.raises(RuntimeFailure) as err:
        await run(bins, "bad")
    assert err.value.message == (
        "network: CNI plugin 'bad' ADD for 'web-0' failed: failed to allocate: range full"
    )
    plugin(bins, "noisy", "echo 'plain trouble' >&2; exit 2")
    with pytest.raises(RuntimeFailure, match=r"'noisy' ADD for 'web-0' failed: plain trouble$"):
        await run(bins, "noisy")


async def test_plugin_missing_or_too_slow_or_not_json(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    with pytest.raises(RuntimeFailure, match=r"plugin 'ghost' not found in .*bin"):
        await run(bins, "ghost")
    plugin(bins, "slow", "exec sleep 30")
    with pytest.raises(RuntimeFailure, match=r"'slow' ADD for 'web-0' took over 0.2s"):
        await run(bins, "slow", timeout=0.2)
    plugin(bins, "mute", "cat >/dev/null; echo hello")
    with pytest.raises(RuntimeFailure, match="'mute' ADD for 'web-0' gave no JSON result"):
        await run(bins, "mute")
