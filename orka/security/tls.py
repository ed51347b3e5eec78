"""Locating a service's cert files and turning them into gRPC TLS credentials."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from orka.errors import Invalid, Unauthenticated
from orka.security import revocation
from orka.security.identity import Identity, identity_from_cert
from orka.security.issue import CA_CERT, CRL_FILE, cert_stem

log = structlog.get_logger("orka.security")

# Seconds between two looks at the CRL: how long a revoked peer may keep a stream open.
DEFAULT_RELOAD_INTERVAL = 5.0
# How often a running server repeats its expiry warning (when due).
EXPIRY_CHECK_INTERVAL = 6 * 3600.0


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


@dataclass(frozen=True)
class Pems:
    """One consistent read of a service's three files, checked the way a peer will check."""

    ca: bytes
    cert: bytes
    key: bytes
    identity: Identity
    leaf: x509.Certificate

    @classmethod
    def read(cls, files: TlsFiles, now: dt.datetime | None = None) -> Pems:
        ca, cert, key = _read(files.ca), _read(files.cert), _read(files.key)
        leaf, identity = _check(files, ca, cert, key, now or dt.datetime.now(dt.UTC))
        return cls(ca=ca, cert=cert, key=key, identity=identity, leaf=leaf)


def renewal_threshold(cert: x509.Certificate) -> dt.timedelta:
    """How long before expiry a certificate is due for renewal: a third of its lifetime, at
    most 30 days. With the 90-day default that is 30 days: a month of warnings in the logs
    before anything breaks, and `orka up` re-issues from then on."""
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    return min(lifetime / 3, dt.timedelta(days=30))


def due_for_renewal(cert: x509.Certificate, now: dt.datetime | None = None) -> bool:
    now = now or dt.datetime.now(dt.UTC)
    return cert.not_valid_after_utc - now <= renewal_threshold(cert)


def warn_if_expiring(path: Path, cert: x509.Certificate, now: dt.datetime | None = None) -> bool:
    """Log a warning when `cert` is due for renewal; whether it did."""
    now = now or dt.datetime.now(dt.UTC)
    if not due_for_renewal(cert, now):
        return False
    left = cert.not_valid_after_utc - now
    log.warning(
        "certificate expires soon; re-issue it with `orka certs rotate`",
        path=str(path),
        expires=cert.not_valid_after_utc.isoformat(),
        days_left=round(left.total_seconds() / 86400, 1),
    )
    return True


def _stamp(files: TlsFiles) -> tuple[tuple[int, int, int], ...]:
    stamps = []
    for p in (files.ca, files.cert, files.key):
        st = os.stat(p)
        stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(stamps)


class ServerCertificates:
    """The certificate-configuration fetcher of a rotating server.

    gRPC calls it before each new handshake; it stats the three files (cheap) and re-reads
    them only when one changed. A re-issued pair is served from the next handshake on, while
    established connections keep their session: rotation needs no restart and drops nothing.
    A half-written rotation (new key, old cert) or a bad file is logged once and skipped; the
    previous configuration keeps being served until a consistent pair appears.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = _stamp(files)
        self._rejected: tuple[tuple[int, int, int], ...] | None = None
        self.current = Pems.read(files)  # the start-up warning is the service's (check_tls)

    def configuration(self, pems: Pems) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(pems.key, pems.cert)], pems.ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        # Called from gRPC's core: it must never raise, and must be quick when nothing changed.
        try:
            stamp = _stamp(self.files)
        except OSError:
            return None  # mid-rename, or deleted: keep serving what we have
        if stamp in (self._stamp, self._rejected):
            return None
        try:
            pems = Pems.read(self.files)
            if pems.identity != self.current.identity:
                raise Invalid(
                    f"certs: {self.files.cert} now names {pems.identity}, "
                    f"not {self.current.identity}"
                )
        except Invalid as e:
            self._rejected = stamp
            log.error("new certificate rejected; serving the previous one", reason=e.message)
            return None
        except Exception:  # never let an error escape into the handshake
            self._rejected = stamp
            log.exception("new certificate rejected; serving the previous one")
            return None
        self._stamp, self.current = stamp, pems
        log.info(
            "certificate reloaded",
            path=str(self.files.cert),
            serial=format(pems.leaf.serial_number, "x"),
            expires=pems.leaf.not_valid_after_utc.isoformat(),
        )
        warn_if_expiring(self.files.cert, pems.leaf)
        return self.configuration(pems)


def _remind(loop: asyncio.AbstractEventLoop, fetcher: ServerCertificates) -> None:
    # A service runs for months: the warning must not wait for a restart or a rotation.
    warn_if_expiring(fetcher.files.cert, fetcher.current.leaf)
    if not loop.is_closed():
        loop.call_later(EXPIRY_CHECK_INTERVAL, _remind, loop, fetcher)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Mutual-TLS server credentials that follow the files on disk (re-issued certificates
    from the next handshake, a new CRL within `files.reload_interval`)."""
    fetcher = ServerCertificates(files)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        # Orka's servers are all grpc.aio; a sync server would have no one to reload the CRL.
        log.warning("no event loop: the CRL is not watched", crl=str(files.crl))
    else:
        revocation.watch(files.crl, files.ca, files.reload_interval)
        loop.call_later(EXPIRY_CHECK_INTERVAL, _remind, loop, fetcher)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.configuration(fetcher.current), fetcher, require_client_authentication=True
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    # Read on each call: a client re-reads its (possibly re-issued) files when it connects.
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


def _check(
    files: TlsFiles, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, now: dt.datetime
) -> tuple[x509.Certificate, Identity]:
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as e:
        raise Invalid(f"certs: {files.ca} is not a PEM certificate: {e}") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise Invalid(f"certs: {files.cert} is not a PEM certificate: {e}") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
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
        return cert, identity_from_cert(cert)
    except Unauthenticated as e:
        raise Invalid(f"certs: {files.cert}: {e.message}") from None


def load_and_check(files: TlsFiles, now: dt.datetime | None = None) -> Identity:
    """Check the files the way a peer will, so a bad flag fails at start-up, not per RPC.

    Returns the identity the cert carries.
    """
    return Pems.read(files, now).identity
