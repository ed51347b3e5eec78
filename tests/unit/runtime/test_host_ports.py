"""The agent's host port allocator, with real sockets (bound only, never connected)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from orka.errors import Invalid, RuntimeFailure
from orka.models import PortBinding, PortProtocol, PortSpec
from orka.runtime.host_ports import HostPorts, in_use, parse_range
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


@pytest.mark.parametrize("text", ["", "20000", "2-1", "0-10", "1-70000", "a-b", "1-2-3"])
def test_bad_ranges_are_named(text: str) -> None:
    with pytest.raises(Invalid, match="must be FIRST-LAST"):
        parse_range(text)


def test_good_range() -> None:
    assert parse_range("20000-32767") == (20000, 32767)
    assert parse_range("5-5") == (5, 5)
