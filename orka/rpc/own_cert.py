"""A server does not serve a certificate its own cluster has revoked.

grpc-python's clients cannot check a CRL in the handshake, nor show the caller the server's
certificate afterwards, so an Orka client would talk to a server holding a revoked
certificate. What the server side can do is refuse to present one: an Orka server will not
start on a revoked certificate, and stops serving (its service then ends, naming the reason)
when a CRL it loads revokes the certificate it would serve. That covers an operator who
revoked a server's certificate and forgot to re-issue it. It does not stop a thief who runs
their own server with a stolen key and no CRL: the remedy for a stolen server key is rotating
it and revoking the old serial, as clients cannot refuse it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

import grpc
import structlog
from cryptography import x509

from orka.errors import Invalid
from orka.security.identity import identity_from_cert
from orka.security.revocation import REVOCATIONS, Revocations
from orka.security.tls import TlsFiles

log = structlog.get_logger("orka.security")

# How long calls in flight get to finish when the server stops for a revoked certificate.
STOP_GRACE = 1.0


def _fix(cert: x509.Certificate) -> str:
    try:
        who = identity_from_cert(cert)
    except Exception:
        return "orka certs rotate"
    return f"orka certs rotate --role {who.role} --name {who.name}"


class OwnCertificate:
    """Watches the certificate a server presents (the one on disk: a re-issued pair is what
    the next handshake serves) against the CRLs its process loads."""

    def __init__(
        self,
        files: TlsFiles,
        server: grpc.aio.Server,
        registry: Revocations = REVOCATIONS,
        on_revoked: Callable[[Invalid], None] | None = None,
    ) -> None:
        self.files = files
        # The service's own shutdown, so that the process ends with the reason (a supervisor
        # restarting it then gets the start-up refusal, naming the fix, until it is re-issued).
        self.on_revoked = on_revoked
        self.server: weakref.ref[grpc.aio.Server] = weakref.ref(server)
        self.registry = registry
        self.stopping: asyncio.Future[None] | None = None

    def _cert(self) -> x509.Certificate | None:
        try:
            return x509.load_pem_x509_certificate(self.files.cert.read_bytes())
        except (OSError, ValueError):
            return None  # mid-rotation: the server keeps serving what it has (tls.py)

    def _refusal(self, cert: x509.Certificate) -> Invalid:
        return Invalid(
            f"certs: {self.files.cert} (serial {cert.serial_number:x}) is revoked by "
            f"{self.files.crl}; a server does not present a revoked certificate: "
            f"re-issue it with `{_fix(cert)}`"
        )

    def check(self) -> None:
        """At start: refuse to serve a revoked certificate, naming it and the fix."""
        cert = self._cert()
        if cert is not None and self.registry.is_revoked(cert.serial_number):
            raise self._refusal(cert)
        self.registry.guards.add(self)

    def revoked(self, serials: frozenset[int]) -> None:
        cert = self._cert()
        server = self.server()
        if cert is None or server is None or self.stopping is not None:
            return
        if cert.serial_number not in serials:
            return
        log.error(
            "this server's own certificate is revoked; stopping the server",
            cert=str(self.files.cert),
            serial=format(cert.serial_number, "x"),
            crl=str(self.files.crl),
            fix=_fix(cert),
        )
        self.registry.guards.discard(self)
        self.stopping = asyncio.ensure_future(server.stop(STOP_GRACE))
        if self.on_revoked is not None:
            self.on_revoked(self._refusal(cert))


def guard(
    files: TlsFiles,
    server: grpc.aio.Server,
    on_revoked: Callable[[Invalid], None] | None = None,
) -> OwnCertificate:
    """Check the server's certificate now and on every new CRL; the guard lives as long as
    the server (the registry only holds it weakly)."""
    own = OwnCertificate(files, server, on_revoked=on_revoked)
    own.check()
    setattr(server, "_orka_own_certificate", own)  # noqa: B010 - keeps the guard alive
    return own
