"""Host ports an agent hands to its instances: picked from a range, or the exact one asked for.

The scheduler already keeps two instances that ask for the same fixed host port off one node;
this is the node's own check, and the picker for `host_port: 0`. A port counts as free when
this agent has not given it out and a socket can bind it on all addresses (another process, or
another agent on the same host, may hold it). For an instance whose traffic reaches it through
DNAT (containers, VMs) nothing on the host listens on the port, so the allocator keeps a bound
socket per port while the instance holds it: that is what stops anyone else on the host taking
it (Kubernetes' kubelet held host ports open the same way). A host-network process binds the
port itself, so the allocator only checks it and lets go.
"""

from __future__ import annotations

import errno
import socket
import threading
from dataclasses import dataclass, field

import psutil

from orka.errors import Invalid, RuntimeFailure
from orka.fit import host_port_in_use
from orka.models import PortBinding, PortProtocol, PortSpec

DEFAULT_RANGE = (20000, 32767)
_ROUTES = "/proc/net/route"
_SOCK_TYPE = {PortProtocol.TCP: socket.SOCK_STREAM, PortProtocol.UDP: socket.SOCK_DGRAM}


def parse_range(text: str) -> tuple[int, int]:
    """`FIRST-LAST` (inclusive), both 1-65535, FIRST <= LAST."""
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo = hi = 0
    if not sep or not (1 <= lo <= hi <= 65535):
        raise Invalid(
            f"host port range {text!r} must be FIRST-LAST with 1 <= FIRST <= LAST <= 65535"
        )
    return lo, hi


def default_host_ip(routes: str = _ROUTES) -> str:
    """The node's address when the operator names none (--host-ip): the IPv4 address of the
    interface the default route leaves by, read from the kernel's tables (no lookup, no
    traffic); 127.0.0.1 when there is no default route (a laptop offline, a test box)."""
    try:
        with open(routes) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return "127.0.0.1"
    addrs = psutil.net_if_addrs()
    for line in lines:
        fields = line.split()
        # Iface Destination Gateway Flags ...: destination 0 is the default route.
        if len(fields) > 1 and fields[1] == "00000000":
            for addr in addrs.get(fields[0], []):
                if addr.family == socket.AF_INET:
                    return str(addr.address)
    return "127.0.0.1"


def in_use(port: int, protocol: PortProtocol) -> str:
    """The scheduler's reason text for a taken port (orka.fit), so the node says it the same."""
    return host_port_in_use(port, protocol).message


def _bind(port: int, protocol: PortProtocol) -> socket.socket | None:
    """A socket bound to the port on every IPv4 address, or None when something holds it."""
    sock = socket.socket(socket.AF_INET, _SOCK_TYPE[protocol])
    try:
        # Not SO_REUSEADDR: a port in TIME_WAIT from an instance that just stopped is fine to
        # give out again only once the kernel lets it go, which is what a plain bind says.
        sock.set_inheritable(False)
        sock.bind(("0.0.0.0", port))
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            return None
        raise RuntimeFailure(f"cannot check host port {port}/{protocol.value}: {exc}") from None
    return sock


@dataclass
class _Held:
    bindings: list[PortBinding]
    sockets: list[socket.socket] = field(default_factory=list)


class HostPorts:
    """The host ports of one agent's instances. Thread-safe: drivers call it from threads."""

    def __init__(self, first: int = DEFAULT_RANGE[0], last: int = DEFAULT_RANGE[1]) -> None:
        if not 1 <= first <= last <= 65535:
            raise Invalid(f"host port range {first}-{last} is not within 1-65535")
        self.first = first
        self.last = last
        self._held: dict[str, _Held] = {}
        self._taken: set[tuple[int, PortProtocol]] = set()
        # Where the next pick starts: spreads picks over the range, so a port given back is not
        # handed out again at once (a client may still talk to the old instance).
        self._cursor = first
        self._lock = threading.Lock()

    def bindings(self, instance: str) -> list[PortBinding]:
        with self._lock:
            held = self._held.get(instance)
            return list(held.bindings) if held else []

    def reserve(self, instance: str, ports: list[PortSpec], hold: bool) -> list[PortBinding]:
        """Host ports for each of `ports`, in order; all or nothing.

        Raises RuntimeFailure ("host port 8080 in use", or the range is full) and keeps nothing
        when one cannot be had. An instance that already holds ports gets the same ones back.
        """
        with self._lock:
            if instance in self._held:
                return list(self._held[instance].bindings)
            got = _Held(bindings=[])
            try:
                for p in ports:
                    sock, number = self._take(p)
                    got.bindings.append(
                        PortBinding(
                            name=p.name,
                            port=p.port if p.port is not None else number,
                            host_port=number,
                            protocol=p.protocol,
                        )
                    )
                    if hold:
                        got.sockets.append(sock)
                    else:
                        sock.close()
            except BaseException:
                self._give_back(got)
                raise
            self._held[instance] = got
            return list(got.bindings)

    def adopt(self, instance: str, bindings: list[PortBinding], hold: bool) -> None:
        """Take back what an instance of an earlier agent process holds (after a restart).

        A port something else took meanwhile stays the instance's: its traffic already goes to
        the instance, and refusing would only lose track of it; it is logged by the caller.
        """
        with self._lock:
            if instance in self._held:
                return
            got = _Held(bindings=list(bindings))
            for b in bindings:
                self._taken.add((b.host_port, b.protocol))
                if hold:
                    sock = _bind(b.host_port, b.protocol)
                    if sock is not None:
                        got.sockets.append(sock)
            self._held[instance] = got

    def release(self, instance: str) -> None:
        """Give the instance's ports back (idempotent)."""
        with self._lock:
            held = self._held.pop(instance, None)
            if held is not None:
                self._give_back(held)

    def close(self) -> None:
        """Close every held socket (the agent stops; the instances keep running)."""
        with self._lock:
            for held in self._held.values():
                for sock in held.sockets:
                    sock.close()
                held.sockets.clear()

    # -- under the lock --------------------------------------------------------------------

    def _take(self, p: PortSpec) -> tuple[socket.socket, int]:
        if p.host_port:
            key = (p.host_port, p.protocol)
            sock = None if key in self._taken else _bind(p.host_port, p.protocol)
            if sock is None:
                raise RuntimeFailure(in_use(p.host_port, p.protocol))
            self._taken.add(key)
            return sock, p.host_port
        size = self.last - self.first + 1
        for i in range(size):
            number = self.first + (self._cursor - self.first + i) % size
            if (number, p.protocol) in self._taken:
                continue
            sock = _bind(number, p.protocol)
            if sock is None:
                continue
            self._taken.add((number, p.protocol))
            self._cursor = self.first + (number - self.first + 1) % size
            return sock, number
        raise RuntimeFailure(
            f"no free host port for {p.name!r} in {self.first}-{self.last} ({p.protocol.value})"
        )

    def _give_back(self, held: _Held) -> None:
        for b in held.bindings:
            self._taken.discard((b.host_port, b.protocol))
        for sock in held.sockets:
            sock.close()
