"""Locating a service's cert files and turning them into gRPC TLS credentials."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from orka.errors import Invalid, Unauthenticated
from orka.security.identity import Identity, identity_from_cert
from orka.security.issue import CA_CERT, CRL_FILE, cert_stem

DEFAULT_RELOAD_INTERVAL = 5.0


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path
    # How often a running service re-reads its CRL (and notices a re-issued certificate).
    reload_interval: float = DEFAULT_RELOAD_INTERVAL

    @property
    def crl(self) -> Path:
        """The CRL beside the CA certificate; it may not exist (nothing revoked yet)."""
        return self.ca.parent / CRL_FILE

    @classmethod
    def for_service(cls, certs_dir: Path | str, role: str, name: str) -> TlsFiles:
        """The service's own folder first (`DIR/<stem>/`), then flat in DIR, so `--certs DIR`,
        `--certs DIR/agent-node-1` and a flat dir from before the split all work."""
        certs_dir = Path(certs_dir)
        # Named cert first so one dir can hold several agents; then the role-wide default.
        stems = list(dict.fromkeys([cert_stem(role, name), role]))
        tried: list[Path] = []
        for stem in stems:
            for folder in (certs_dir / stem, certs_dir):
                cert = folder / f"{stem}.crt"
                tried.append(cert)
                if not cert.is_file():
                    continue
                key = cert.with_suffix(".key")
                if not key.is_file():
                    raise Invalid(f"certs: found {cert} but its key {key} does not exist")
                ca = folder / CA_CERT
                if not ca.is_file():
                    raise Invalid(f"certs: {ca} does not exist")
                return cls(ca=ca, cert=cert, key=key)
        if not (certs_dir / CA_CERT).is_file():
            raise Invalid(f"certs: {certs_dir / CA_CERT} does not exist")
        raise Invalid(
            f"certs: no certificate for {role} {name!r}; tried {', '.join(map(str, tried))}"
        )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise Invalid(f"certs: cannot read {path}: {e.strerror or e}") from None


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(_read(files.key), _read(files.cert))],
        root_certificates=_read(files.ca),
        require_client_auth=True,
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca),
        private_key=_read(files.key),
        certificate_chain=_read(files.cert),
    )


def _check_validity(path: Path, cert: x509.Certificate, now: dt.datetime) -> None:
    if now < cert.not_valid_before_utc:
        raise Invalid(f"certs: {path} is not valid until {cert.not_valid_before_utc.isoformat()}")
    if now > cert.not_valid_after_utc:
        raise Invalid(f"certs: {path} expired at {cert.not_valid_after_utc.isoformat()}")


def load_and_check(files: TlsFiles, now: dt.datetime | None = None) -> Identity:
    """Check the files the way a peer will, so a bad flag fails at start-up, not per RPC.

    Returns the identity the cert carries.
    """
    now = now or dt.datetime.now(dt.UTC)
    try:
        ca = x509.load_pem_x509_certificate(_read(files.ca))
    except ValueError as e:
        raise Invalid(f"certs: {files.ca} is not a PEM certificate: {e}") from None
    try:
        cert = x509.load_pem_x509_certificate(_read(files.cert))
    except ValueError as e:
        raise Invalid(f"certs: {files.cert} is not a PEM certificate: {e}") from None
    try:
        key = serialization.load_pem_private_key(_read(files.key), password=None)
    except (ValueError, TypeError) as e:
        raise Invalid(f"certs: {files.key} is not an unencrypted PEM private key: {e}") from None
    if key.public_key() != cert.public_key():
        raise Invalid(f"certs: {files.key} does not match {files.cert}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise Invalid(f"certs: {files.cert} is not signed by the CA in {files.ca}") from None
    _check_validity(files.ca, ca, now)
    _check_validity(files.cert, cert, now)
    try:
        return identity_from_cert(cert)
    except Unauthenticated as e:
        raise Invalid(f"certs: {files.cert}: {e.message}") from None
