"""Who is on the other end of a connection, read from the SAN URI of their certificate."""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import grpc
from cryptography import x509

from orka.errors import Invalid, PermissionDenied, Unauthenticated
from orka.security import peer_cert
from orka.security.ca import (
    ROLES,
    SERVING_ROLES,
    SPIFFE_PREFIX,
    role_dns_name,
    spiffe_uri,
    validate_name,
)
from orka.security.peer_cert import PEERS
from orka.security.revocation import REVOCATIONS

# gRPC's auth-context key for the verified peer certificate (PEM).
PEER_CERT_KEY = "x509_pem_cert"


@dataclass(frozen=True)
class Identity:
    role: str
    name: str

    @property
    def uri(self) -> str:
        return spiffe_uri(self.role, self.name)

    def __str__(self) -> str:
        return f"{self.role}/{self.name}"


def identity_from_cert(cert: x509.Certificate) -> Identity:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise Unauthenticated("certificate has no subjectAltName extension") from None
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    # Exactly one URI: with several, which one names the peer would be ambiguous.
    if len(uris) != 1:
        raise Unauthenticated(
            f"certificate must carry exactly one SAN URI {SPIFFE_PREFIX}<role>/<name>, "
            f"found {len(uris)}"
        )
    uri = uris[0]
    if not uri.startswith(SPIFFE_PREFIX):
        raise Unauthenticated(f"certificate SAN URI {uri!r} does not start with {SPIFFE_PREFIX}")
    parts = uri[len(SPIFFE_PREFIX) :].split("/")
    if len(parts) != 2:
        raise Unauthenticated(f"certificate SAN URI {uri!r} is not {SPIFFE_PREFIX}<role>/<name>")
    role, name = parts
    if role not in ROLES:
        raise Unauthenticated(f"certificate SAN URI {uri!r} has unknown role {role!r}")
    try:
        validate_name(name)
    except Invalid:
        raise Unauthenticated(f"certificate SAN URI {uri!r} has an invalid name") from None
    return Identity(role=role, name=name)


# Every RPC re-reads the peer cert: kept per peer (orka.security.peer_cert), so a call costs
# no ASN.1 decode. Failures raise and so are never cached.
@functools.lru_cache(maxsize=PEERS)
def identity_from_pem(pem: bytes) -> Identity:
    return identity_from_cert(peer_cert.load(pem))


def peer_identity(context: grpc.aio.ServicerContext) -> Identity:
    # The TLS layer already verified the chain against the cluster CA; this only names the peer.
    certs = context.auth_context().get(PEER_CERT_KEY) or []
    if not certs:
        raise Unauthenticated("no client certificate")
    pem = bytes(certs[0])
    REVOCATIONS.admit(pem, context)  # refuses a revoked peer (the handshake cannot: see there)
    return identity_from_pem(pem)


def require_role(context: grpc.aio.ServicerContext, roles: Collection[str]) -> Identity:
    ident = peer_identity(context)
    if ident.role not in roles:
        raise PermissionDenied(
            f"role {ident.role} may not call this API; allowed: {', '.join(sorted(roles))}"
        )
    return ident


def names_role(cert: x509.Certificate, role: str) -> bool:
    """Whether a server certificate carries the reserved DNS name clients check `role` by."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return role_dns_name(role) in san.get_values_for_type(x509.DNSName)


def check_serves_as(pem: bytes, role: str, where: str) -> None:
    """A server's own certificate must carry its role's reserved DNS name, or every Orka
    client refuses it at the handshake; say so at start-up instead, naming the fix."""
    if role not in SERVING_ROLES:
        return
    want = role_dns_name(role)
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise Invalid(f"certs: {where} is not a PEM certificate: {e}") from None
    if not names_role(cert, role):
        raise Invalid(
            f"certs: {where} lacks the DNS name {want} that Orka's clients verify a {role} "
            f"by (issued by an older Orka?); re-issue it: "
            f"orka certs issue --role {role} --name {role}"
        )
