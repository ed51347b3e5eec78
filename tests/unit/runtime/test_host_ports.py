"""The agent's host port allocator, with real sockets (bound only, never connected)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from orka.errors import Invalid, RuntimeFailure
from orka.models import PortBinding, PortProtocol, PortSpec
from orka.runtime import host_ports
from orka.runtime.host_ports import HostPorts, default_host_ip, in_use, parse_range
from tests.ports import free_block


def bindable(port: int, kind: int = socket.SOCK_STREAM) -> bool:
    s = socket.socket(socket.AF_INET, kind)
    try:
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


@pytest.fixture
def block() -> Iterator[int]:
    yield free_block(3)


def web(host_port: int = 0, name: str = "http", protocol: str = "tcp") -> PortSpec:
    return PortSpec(name=name, port=8080, host_port=host_port, protocol=PortProtocol(protocol))


def test_picks_distinct_ports_and_holds_them_until_released(block: int) -> None:
    ports = HostPorts(block, block + 2)
    a = ports.reserve("a", [web()], hold=True)
    b = ports.reserve("b", [web()], hold=True)
    assert [p.host_port for p in a] == [block]
    assert [p.host_port for p in b] == [block + 1]
    assert a[0] == PortBinding(name="http", port=8080, host_port=block, protocol=PortProtocol.TCP)
    # Held: nothing else on the host can take them while the instances have them.
    assert not bindable(block) and not bindable(block + 1)
    assert ports.bindings("a") == a
    # Asking again for a holder gives the same ports (a restart of the instance).
    assert ports.reserve("a", [web()], hold=True) == a
    ports.release("a")
    ports.release("a")
    assert bindable(block)
    assert ports.bindings("a") == []
    ports.close()
    assert bindable(block + 1)


def test_a_process_port_is_checked_but_not_kept_bound(block: int) -> None:
    ports = HostPorts(block, block + 2)
    got = ports.reserve("p", [PortSpec(name="http")], hold=False)
    # The process binds it itself; the binding names the host port as its port too.
    assert got == [PortBinding(name="http", port=block, host_port=block)]
    assert bindable(block)
    # ...but this agent does not hand it out twice.
    assert ports.reserve("q", [PortSpec(name="http")], hold=False)[0].host_port == block + 1


def test_a_fixed_port_held_elsewhere_is_refused_and_nothing_is_kept(block: int) -> None:
    ports = HostPorts(block, block + 1)
    other = socket.socket()
    other.bind(("0.0.0.0", block + 2))
    try:
        with pytest.raises(RuntimeFailure) as err:
            ports.reserve("a", [web(name="dyn"), web(block + 2, name="fixed")], hold=True)
        assert err.value.message == f"host port {block + 2} in use"
        # All or nothing: the dynamic port picked first was given back.
        assert ports.bindings("a") == []
        assert bindable(block)
    finally:
        other.close()
    # The same fixed port twice on this agent: the second is refused.
    ports.reserve("a", [web(block + 2)], hold=True)
    with pytest.raises(RuntimeFailure, match=f"^host port {block + 2} in use$"):
        ports.reserve("b", [web(block + 2)], hold=True)


def test_udp_and_tcp_are_separate_ports(block: int) -> None:
    ports = HostPorts(block, block)
    tcp = ports.reserve("a", [web(block)], hold=True)
    udp = ports.reserve("b", [web(block, protocol="udp")], hold=True)
    assert (tcp[0].host_port, udp[0].host_port) == (block, block)
    assert not bindable(block, socket.SOCK_DGRAM)
    assert in_use(53, PortProtocol.UDP) == "host port 53/udp in use"
    assert in_use(8080, PortProtocol.TCP) == "host port 8080 in use"


def test_a_full_range_names_the_range(block: int) -> None:
    ports = HostPorts(block, block)
    ports.reserve("a", [web()], hold=True)
    with pytest.raises(RuntimeFailure) as err:
        ports.reserve("b", [web()], hold=True)
    assert err.value.message == f"no free host port for 'http' in {block}-{block} (tcp)"


def test_adopted_ports_are_not_given_out_again(block: int) -> None:
    ports = HostPorts(block, block + 1)
    ports.adopt("old", [PortBinding(name="http", port=8080, host_port=block)], hold=True)
    assert not bindable(block)
    assert ports.reserve("new", [web()], hold=True)[0].host_port == block + 1
    with pytest.raises(RuntimeFailure, match="in use"):
        ports.reserve("x", [web(block)], hold=True)
    ports.release("old")
    assert bindable(block)


@pytest.mark.parametrize(
    "text", ["", "20000", "2-1", "0-10", "0-0", "1-65536", "1-70000", "a-b", "1-2-3"]
)
def test_bad_ranges_are_named(text: str) -> None:
    with pytest.raises(Invalid, match="must be FIRST-LAST"):
        parse_range(text)


def test_good_range() -> None:
    assert parse_range("20000-32767") == (20000, 32767)
    assert parse_range("5-5") == (5, 5)
    assert parse_range("1-65535") == (1, 65535)
    assert parse_range("1-1") == (1, 1)


def test_a_range_is_checked_when_the_allocator_is_made() -> None:
    assert (HostPorts(1, 65535).first, HostPorts(1, 65535).last) == (1, 65535)
    assert HostPorts(65535, 65535).first == 65535
    for first, last in ((0, 10), (1, 65536), (10, 9)):
        with pytest.raises(Invalid) as err:
            HostPorts(first, last)
        assert err.value.message == f"host port range {first}-{last} is not within 1-65535"


def test_a_fixed_port_is_given_once_even_when_not_held(block: int) -> None:
    """A host-network process binds its port itself, later: until it does, only this agent's
    own record keeps a second instance off the port."""
    ports = HostPorts(block, block + 1)
    ports.reserve("a", [web(block + 2)], hold=False)
    assert bindable(block + 2)
    with pytest.raises(RuntimeFailure, match=f"^host port {block + 2} in use$"):
        ports.reserve("b", [web(block + 2)], hold=False)
    # Released, it can be had again.
    ports.release("a")
    assert ports.reserve("b", [web(block + 2)], hold=False)[0].host_port == block + 2


def test_a_port_given_back_is_not_taken_by_a_fixed_request_in_the_meantime(block: int) -> None:
    ports = HostPorts(block, block + 2)
    ports.reserve("a", [web(block + 1)], hold=True)
    ports.release("a")
    assert ports.reserve("b", [web(block + 1)], hold=True)[0].host_port == block + 1


def test_picks_walk_up_from_the_last_one_and_wrap() -> None:
    block = free_block(4)
    ports = HostPorts(block, block + 3)
    other = socket.socket()
    other.bind(("0.0.0.0", block + 1))
    try:
        assert ports.reserve("a", [web()], hold=True)[0].host_port == block
        # The next port is held elsewhere: the one after it, not one below.
        assert ports.reserve("b", [web()], hold=True)[0].host_port == block + 2
    finally:
        other.close()
    ports.release("a")
    # Past the end the walk wraps, skips what this agent holds and takes what is free.
    assert ports.reserve("c", [web()], hold=True)[0].host_port == block + 3
    assert ports.reserve("d", [web()], hold=True)[0].host_port == block
    assert ports.reserve("e", [web()], hold=True)[0].host_port == block + 1


def test_picks_for_processes_never_repeat_a_port_this_agent_gave_out(block: int) -> None:
    ports = HostPorts(block, block + 1)
    got = [ports.reserve(name, [PortSpec(name="http")], hold=False) for name in "ab"]
    assert [g[0].host_port for g in got] == [block, block + 1]
    with pytest.raises(RuntimeFailure, match="no free host port"):
        ports.reserve("c", [PortSpec(name="http")], hold=False)
    ports.release("a")
    assert ports.reserve("c", [PortSpec(name="http")], hold=False)[0].host_port == block


def test_adopted_process_ports_are_not_given_out_again(block: int) -> None:
    ports = HostPorts(block, block)
    ports.adopt("old", [PortBinding(name="http", port=block, host_port=block)], hold=False)
    with pytest.raises(RuntimeFailure, match=f"^host port {block} in use$"):
        ports.reserve("new", [web(block)], hold=False)
    with pytest.raises(RuntimeFailure, match="no free host port"):
        ports.reserve("new", [PortSpec(name="http")], hold=False)


def test_a_udp_binding_says_udp(block: int) -> None:
    ports = HostPorts(block, block)
    assert ports.reserve("a", [web(protocol="udp")], hold=True) == [
        PortBinding(name="http", port=8080, host_port=block, protocol=PortProtocol.UDP)
    ]


def test_a_held_port_is_not_inherited_by_the_processes_the_agent_starts(block: int) -> None:
    """A workload started with every inheritable descriptor (close_fds=False) must not get the
    socket holding another instance's port: it could accept that instance's traffic."""
    ports = HostPorts(block, block)
    ports.reserve("a", [web()], hold=True)
    held = {os.fstat(s.fileno()).st_ino for s in ports._held["a"].sockets}
    assert len(held) == 1
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; print(*[os.readlink('/proc/self/fd/' + f) "
            "for f in os.listdir('/proc/self/fd') if os.path.exists('/proc/self/fd/' + f)])",
        ],
        close_fds=False,
        capture_output=True,
        text=True,
        check=True,
    )
    assert not {f"socket:[{inode}]" for inode in held} & set(child.stdout.split())


def test_a_port_that_cannot_be_checked_is_an_error_naming_it(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(socket.socket):
        def bind(self, address: object) -> None:
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))

    monkeypatch.setattr(socket, "socket", Broken)
    with pytest.raises(RuntimeFailure) as err:
        HostPorts(block, block).reserve("a", [web(block, protocol="udp")], hold=True)
    assert err.value.message == (
        f"cannot check host port {block}/udp: [Errno {errno.ENOBUFS}] {os.strerror(errno.ENOBUFS)}"
    )


ROUTES = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"
    "eth1\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
    "eth0\t00000000\t0102A8C0\t0003\t0\t0\t0\t00000000\n"
)


def _addrs(monkeypatch: pytest.MonkeyPatch, table: dict[str, list[tuple[int, str]]]) -> None:
    fake = {
        iface: [SimpleNamespace(family=family, address=address) for family, address in addrs]
        for iface, addrs in table.items()
    }
    monkeypatch.setattr(host_ports.psutil, "net_if_addrs", lambda: fake)


def test_the_default_address_is_the_default_routes_ipv4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    routes = tmp_path / "route"
    routes.write_text(ROUTES)
    _addrs(
        monkeypatch,
        {
            "eth1": [(socket.AF_INET, "192.168.0.5")],
            "eth0": [(socket.AF_INET6, "fe80::1"), (socket.AF_INET, "192.168.2.7")],
        },
    )
    assert default_host_ip(str(routes)) == "192.168.2.7"
    header, other, default = ROUTES.splitlines()
    routes.write_text(f"{header}\n{default}\n{other}\n")
    assert default_host_ip(str(routes)) == "192.168.2.7"


def test_without_a_default_route_or_its_address_the_default_is_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    routes = tmp_path / "route"
    _addrs(monkeypatch, {"eth0": [(socket.AF_INET6, "fe80::1")], "eth1": []})
    assert default_host_ip(str(routes)) == "127.0.0.1"  # no table at all
    routes.write_text(ROUTES)
    assert default_host_ip(str(routes)) == "127.0.0.1"  # its interface has no IPv4 address
    _addrs(monkeypatch, {"eth1": [(socket.AF_INET, "192.168.0.5")]})
    assert default_host_ip(str(routes)) == "127.0.0.1"  # its interface is gone
    header, other, _ = ROUTES.splitlines()
    routes.write_text(f"{header}\n{other}\n\ntruncated\n")
    _addrs(monkeypatch, {"eth0": [(socket.AF_INET, "192.168.2.7")]})
    assert default_host_ip(str(routes)) == "127.0.0.1"  # no default route, a blank and a cut line
