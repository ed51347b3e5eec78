"""A server's guard over its own certificate (`orka.rpc.own_cert`), against a stand-in server
that records how it was asked to stop: refused at start, stopped once on a CRL that revokes
it, and told why; left alone by anything else."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from structlog.testing import capture_logs

from orka.errors import Invalid
from orka.rpc.own_cert import STOP_GRACE, OwnCertificate, guard
from orka.security.issue import load_ca
from orka.security.revocation import REVOCATIONS, Revocations
from orka.security.revoke import serial_of
from orka.security.tls import TlsFiles
from tests.unit.security.handmade import handmade


class Server:
    def __init__(self) -> None:
        self.stops: list[float | None] = []

    async def stop(self, grace: float | None) -> None:
        self.stops.append(grace)


def _files(certs: Path) -> TlsFiles:
    return TlsFiles.for_service(certs, "controller", "controller")


def _refusal(certs: Path, serial: int, fix: str) -> str:
    files = _files(certs)
    return (
        f"certs: {files.cert} (serial {serial:x}) is revoked by {files.crl}; a server does not "
        f"present a revoked certificate: re-issue it with `{fix}`"
    )


FIX = "orka certs rotate --role controller --name controller"


def test_a_server_does_not_start_on_a_revoked_certificate(certs: Path) -> None:
    own_serial = serial_of(certs, "controller", "controller")
    registry = Revocations()
    registry.update(certs / "crl.pem", frozenset({own_serial}))
    own = OwnCertificate(_files(certs), Server(), registry)  # type: ignore[arg-type]
    with pytest.raises(Invalid) as info:
        own.check()
    assert info.value.message == _refusal(certs, own_serial, FIX)
    assert own not in registry.guards


def test_a_certificate_without_an_identity_is_refused_with_the_plain_fix(certs: Path) -> None:
    ca = load_ca(certs)
    files = _files(certs)
    bare = handmade("x", ca.key.public_key(), ca.key, ca.cert.subject, serial=77)
    files.cert.write_bytes(bare.public_bytes(serialization.Encoding.PEM))
    registry = Revocations()
    registry.update(certs / "crl.pem", frozenset({77}))
    with pytest.raises(Invalid) as info:
        OwnCertificate(files, Server(), registry).check()  # type: ignore[arg-type]
    assert info.value.message == _refusal(certs, 77, "orka certs rotate")


async def test_a_crl_revoking_the_servers_certificate_stops_it_once_and_says_why(
    certs: Path,
) -> None:
    own_serial = serial_of(certs, "controller", "controller")
    registry = Revocations()
    server = Server()
    told: list[Invalid] = []
    own = OwnCertificate(_files(certs), server, registry, on_revoked=told.append)  # type: ignore[arg-type]
    own.check()
    assert own in registry.guards
    admin = serial_of(certs, "admin", "admin")
    registry.update(certs / "crl.pem", frozenset({admin}))  # someone else's: nothing happens
    assert own.stopping is None and told == []

    with capture_logs() as logs:
        registry.update(certs / "crl.pem", frozenset({admin, own_serial}))
        registry.update(certs / "crl.pem", frozenset({admin, own_serial, 12345}))  # once only
    assert own.stopping is not None
    await own.stopping
    assert server.stops == [STOP_GRACE]
    assert [t.message for t in told] == [_refusal(certs, own_serial, FIX)]
    files = _files(certs)
    assert logs == [
        {
            "event": "this server's own certificate is revoked; stopping the server",
            "log_level": "error",
            "cert": str(files.cert),
            "serial": format(own_serial, "x"),
            "crl": str(files.crl),
            "fix": FIX,
        }
    ]
    assert own not in registry.guards


def test_nothing_is_stopped_without_a_certificate_or_a_server(certs: Path) -> None:
    own_serial = serial_of(certs, "controller", "controller")
    registry = Revocations()
    server = Server()
    own = OwnCertificate(_files(certs), server, registry)  # type: ignore[arg-type]
    own.check()
    saved = _files(certs).cert.read_bytes()
    _files(certs).cert.write_bytes(b"half a rotation")
    own.revoked(frozenset({own_serial}))
    assert own.stopping is None
    _files(certs).cert.write_bytes(saved)
    del server  # the server is gone: its guard has nothing to stop
    own.revoked(frozenset({own_serial}))
    assert own.stopping is None


async def test_guard_checks_at_once_and_passes_the_shutdown_on(certs: Path) -> None:
    """With the process's own registry, as the servers use it; the test's CRL file is
    forgotten after it, so no other test sees its serial."""
    server = Server()
    told: list[Invalid] = []
    own = guard(_files(certs), server, on_revoked=told.append)  # type: ignore[arg-type]
    assert own in REVOCATIONS.guards
    try:
        REVOCATIONS.update(
            certs / "crl.pem", frozenset({serial_of(certs, "controller", "controller")})
        )
        assert own.stopping is not None
        await own.stopping
    finally:
        REVOCATIONS.forget(certs / "crl.pem")
    assert len(told) == 1 and server.stops == [STOP_GRACE]
