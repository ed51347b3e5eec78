"""The cluster CA and the certificates it signs: pure crypto, no files (see `issue.py`)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from orka.errors import Invalid

ROLES: tuple[str, ...] = ("controller", "scheduler", "agent", "admin", "viewer")
# Roles whose certificates a listening server presents: only these carry host names, the
# reserved role name and serverAuth. Agents, admins and viewers only ever dial out.
SERVING_ROLES: frozenset[str] = frozenset({"controller", "scheduler"})
SPIFFE_PREFIX = "spiffe://orka/"
# Every serving certificate carries the DNS name `<role>.orka` (`controller.orka`,
# `scheduler.orka`), and Orka's clients verify the server against that name rather than the
# address they dialled (gRPC's `ssl_target_name_override`). Python gRPC clients cannot read
# the server's certificate, so this is how a client checks the server's role in the
# handshake itself, as Nomad does with `server.<region>.nomad`. The whole `.orka` namespace is
# reserved: no --host may claim a name in it.
ROLE_DNS_DOMAIN = "orka"
CA_COMMON_NAME = "orka cluster CA"
CA_DAYS = 3650
LEAF_DAYS = 365
# Backdate notBefore so a peer whose clock is slightly behind ours still accepts a fresh cert.
CLOCK_SKEW = dt.timedelta(minutes=5)

_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class CertificateAuthority:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class IssuedCert:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def validate_role(role: str) -> str:
    if role not in ROLES:
        raise Invalid(f"role: {role!r} is not one of {', '.join(ROLES)}")
    return role


def validate_name(name: str) -> str:
    if len(name) > 63 or not _NAME_RE.fullmatch(name):
        raise Invalid(
            f"name: {name!r} must be a DNS label (lowercase letters, digits and '-', "
            "not starting or ending with '-', at most 63 characters)"
        )
    return name


def spiffe_uri(role: str, name: str) -> str:
    return f"{SPIFFE_PREFIX}{role}/{name}"


def role_dns_name(role: str) -> str:
    """The reserved DNS name a server of `role` proves in the handshake."""
    if role not in SERVING_ROLES:
        raise Invalid(
            f"role: {role!r} does not serve; servers are {', '.join(sorted(SERVING_ROLES))}"
        )
    return f"{role}.{ROLE_DNS_DOMAIN}"


def is_reserved_host(name: str) -> bool:
    name = name.lower().rstrip(".")
    return name == ROLE_DNS_DOMAIN or name.endswith(f".{ROLE_DNS_DOMAIN}")


def _short(value: str, limit: int = 80) -> str:
    # Errors name the bad input without echoing an unbounded amount of it.
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def create_ca(
    *,
    not_valid_before: dt.datetime | None = None,
    not_valid_after: dt.datetime | None = None,
) -> CertificateAuthority:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    start = not_valid_before or (_now() - CLOCK_SKEW)
    end = not_valid_after or (start + dt.timedelta(days=CA_DAYS))
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertificateAuthority(cert=cert, key=key)


def local_host_names() -> list[str]:
    names = ["localhost"]
    host = socket.gethostname()
    # getfqdn can hit DNS; that is acceptable at cert-issue time, and it falls back to host.
    for candidate in (host, socket.getfqdn()):
        if candidate and candidate not in names:
            names.append(candidate)
    return names


def split_hosts(hosts: Iterable[str]) -> tuple[list[str], list[IpAddress]]:
    """Sort caller-given hosts into DNS names and IPs, deduplicated, order kept."""
    dns: list[str] = []
    ips: list[IpAddress] = []
    for raw in hosts:
        host = raw.strip()
        if not host:
            continue
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            name = host.lower()
            if not name.isascii():
                # x509 DNSName must be IA5 (ASCII); IDNA encoding is the caller's job.
                raise Invalid(
                    f"hosts: {_short(raw)} is not an ASCII DNS name or IP address"
                ) from None
            if is_reserved_host(name):
                raise Invalid(
                    f"hosts: {_short(raw)} is reserved: names under .{ROLE_DNS_DOMAIN} name a "
                    "server's role and Orka adds them itself"
                ) from None
            if name not in dns:
                dns.append(name)
        else:
            if ip not in ips:
                ips.append(ip)
    return dns, ips


def issue_leaf(
    ca: CertificateAuthority,
    role: str,
    name: str,
    hosts: Iterable[str] = (),
    *,
    days: int = LEAF_DAYS,
    not_valid_before: dt.datetime | None = None,
    not_valid_after: dt.datetime | None = None,
) -> IssuedCert:
    validate_role(role)
    validate_name(name)
    if days <= 0:
        raise Invalid(f"days: must be positive, got {days}")
    host_list = list(hosts)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(role, name))]
    if role in SERVING_ROLES:
        # split_hosts refuses a caller's name under .orka; a host that happens to be named
        # so itself is left out instead, so that issuing never fails for the machine's name.
        local = [n for n in local_host_names() if not is_reserved_host(n)]
        dns, ips = split_hosts([*local, "127.0.0.1", "::1", *host_list])
        sans.append(x509.DNSName(role_dns_name(role)))
        sans += [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ip) for ip in ips]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    else:
        if any(h.strip() for h in host_list):
            raise Invalid(
                f"hosts: {role} certificates only dial out, so they carry no host names; "
                f"--host belongs to {' and '.join(sorted(SERVING_ROLES))} certificates"
            )
        # clientAuth only: BoringSSL then refuses it in any server's hands at the handshake.
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]

    key = _new_key()
    start = not_valid_before or (_now() - CLOCK_SKEW)
    end = not_valid_after or (start + dt.timedelta(days=days))
    public = key.public_key()
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{role}/{name}")]))
        .issuer_name(ca.cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca.key, hashes.SHA256())
    )
    return IssuedCert(cert=cert, key=key)


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted PKCS#8: what gRPC and grpcurl both read without a passphrase prompt.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
