from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from orka.errors import Invalid, PermissionDenied, Unauthenticated
from orka.security import peer_cert
from orka.security.ca import cert_pem, create_ca, issue_leaf
from orka.security.identity import (
    Identity,
    check_serves_as,
    identity_from_pem,
    peer_identity,
    require_role,
)
from orka.security.revocation import REVOCATIONS, REVOKED_DETAILS


def _cert_with_sans(sans: list[x509.GeneralName] | None) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if sans is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return cert_pem(builder.sign(key, hashes.SHA256()))


URI = x509.UniformResourceIdentifier


def test_issued_cert_identity() -> None:
    leaf = issue_leaf(create_ca(), "agent", "node-1")
    ident = identity_from_pem(cert_pem(leaf.cert))
    assert ident == Identity("agent", "node-1")
    assert ident.uri == "spiffe://orka/agent/node-1"


@pytest.mark.parametrize(
    ("sans", "problem"),
    [
        (None, "no subjectAltName"),
        ([x509.DNSName("localhost")], "found 0"),
        ([URI("spiffe://orka/admin/a"), URI("spiffe://orka/admin/b")], "found 2"),
        ([URI("https://orka/admin/admin")], "does not start with"),
        ([URI("spiffe://other/admin/admin")], "does not start with"),
        ([URI("spiffe://orka/root/admin")], "unknown role"),
        ([URI("spiffe://orka/admin")], "is not spiffe://orka/<role>/<name>"),
        ([URI("spiffe://orka/admin/a/b")], "is not spiffe://orka/<role>/<name>"),
        ([URI("spiffe://orka/admin/Bad_Name")], "invalid name"),
    ],
)
def test_bad_identities(sans: list[x509.GeneralName] | None, problem: str) -> None:
    with pytest.raises(Unauthenticated) as exc:
        identity_from_pem(_cert_with_sans(sans))
    assert problem in exc.value.message


def test_no_san_message_is_exact() -> None:
    # The whole message, not a piece of it: a mangled message still contains its middle.
    with pytest.raises(Unauthenticated) as exc:
        identity_from_pem(_cert_with_sans(None))
    assert exc.value.message == "certificate has no subjectAltName extension"


def test_garbage_pem() -> None:
    with pytest.raises(Unauthenticated, match="does not parse"):
        identity_from_pem(b"not a cert")


def _context(auth: dict[str, list[bytes]]) -> Any:
    return SimpleNamespace(auth_context=lambda: auth)


def test_peer_identity_and_require_role() -> None:
    pem = cert_pem(issue_leaf(create_ca(), "admin", "admin").cert)
    ctx = _context({"x509_pem_cert": [pem]})
    assert peer_identity(ctx) == Identity("admin", "admin")
    assert require_role(ctx, {"admin"}) == Identity("admin", "admin")
    with pytest.raises(PermissionDenied, match="role admin may not call this API; allowed: agent"):
        require_role(ctx, ["agent"])
    with pytest.raises(PermissionDenied) as exc:
        require_role(ctx, ["viewer", "agent"])
    assert exc.value.message == "role admin may not call this API; allowed: agent, viewer"


def test_no_client_certificate() -> None:
    with pytest.raises(Unauthenticated, match=r"^no client certificate$"):
        peer_identity(_context({"transport_security_type": [b"ssl"]}))


def test_check_serves_as_wants_the_role_name() -> None:
    ca = create_ca()
    check_serves_as(cert_pem(issue_leaf(ca, "scheduler", "scheduler").cert), "scheduler", "s")
    check_serves_as(cert_pem(issue_leaf(ca, "controller", "c2").cert), "controller", "c")
    # Client roles never serve, so there is nothing to check.
    check_serves_as(cert_pem(issue_leaf(ca, "agent", "node-1").cert), "agent", "a")
    # A controller certificate does not name the scheduler role, nor one without any DNS name.
    controller = cert_pem(issue_leaf(ca, "controller", "controller").cert)
    with pytest.raises(Invalid, match=r"^certs: s.crt lacks the DNS name scheduler.orka .*"):
        check_serves_as(controller, "scheduler", "s.crt")
    old = _cert_with_sans([URI("spiffe://orka/scheduler/scheduler")])
    with pytest.raises(Invalid, match=r"orka certs issue --role scheduler --name scheduler"):
        check_serves_as(old, "scheduler", "s.crt")


def test_check_serves_as_refuses_no_san_and_garbage() -> None:
    # A certificate with no subjectAltName at all names no role (names_role is False for it).
    with pytest.raises(Invalid, match=r"^certs: s.crt lacks the DNS name scheduler.orka "):
        check_serves_as(_cert_with_sans(None), "scheduler", "s.crt")
    with pytest.raises(Invalid, match=r"^certs: s.crt is not a PEM certificate: "):
        check_serves_as(b"not a cert", "scheduler", "s.crt")


async def test_peer_identity_registers_the_call_for_cutting(tmp_path: Path) -> None:
    # peer_identity hands the call's own context to the revocation registry: a CRL that later
    # revokes the peer aborts that very call with UNAUTHENTICATED (not just cancels its task).
    leaf = issue_leaf(create_ca(), "admin", "admin")
    aborted: list[tuple[grpc.StatusCode, str, object]] = []

    async def abort(code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        aborted.append((code, details, trailing_metadata))

    ctx = SimpleNamespace(
        auth_context=lambda: {"x509_pem_cert": [cert_pem(leaf.cert)]}, abort=abort
    )
    admitted = asyncio.Event()

    async def call() -> None:
        peer_identity(ctx)
        admitted.set()
        await asyncio.Event().wait()  # a long-running stream

    task = asyncio.create_task(call())
    await admitted.wait()
    crl = tmp_path / "crl.pem"
    try:
        assert REVOCATIONS.update(crl, frozenset({leaf.cert.serial_number})) == 1
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
    finally:
        REVOCATIONS.forget(crl)
    assert aborted == [(grpc.StatusCode.UNAUTHENTICATED, "certificate revoked", REVOKED_DETAILS)]


def test_a_call_parses_its_peer_certificate_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The revocation check (the serial) and the identity of one call share one parse, and a
    peer's later calls parse nothing: at thousands of agents registering at once, each
    registration used to parse the certificate twice."""
    pem = cert_pem(issue_leaf(create_ca(), "agent", "node-parse-once").cert)
    parses: list[bytes] = []
    real = x509.load_pem_x509_certificate

    def counting(data: bytes) -> x509.Certificate:
        parses.append(data)
        return real(data)

    monkeypatch.setattr(peer_cert.x509, "load_pem_x509_certificate", counting)
    ctx = _context({"x509_pem_cert": [pem]})
    REVOCATIONS.admit(pem, ctx)  # what the interceptor does first
    assert peer_identity(ctx) == Identity("agent", "node-parse-once")
    assert parses == [pem]
    assert peer_identity(_context({"x509_pem_cert": [bytes(pem)]})).name == "node-parse-once"
    assert parses == [pem]
