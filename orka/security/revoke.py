"""`orka certs revoke`: the cluster's CRL, signed by the CA, published to every service folder.

Services pick a new CRL up within their reload interval (`revocation.py`); nothing restarts.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from orka.errors import Invalid, NotFound
from orka.security.issue import CRL_FILE, load_ca, service_folders, write_public
from orka.security.revocation import crl_number, parse_crl
from orka.security.tls import TlsFiles

# Services never treat a CRL as stale (an expired CRL would either un-revoke every key or lock
# every peer out); nextUpdate is only for other tools reading the file, so it is set far out.
CRL_NEXT_UPDATE = dt.timedelta(days=365)


def parse_serial(text: str) -> int:
    """A serial as `openssl x509 -serial` and our logs print it: hex, `:` and `0x` allowed."""
    cleaned = text.strip().lower().removeprefix("0x").replace(":", "")
    if not cleaned or len(cleaned) > 40:
        raise Invalid("serial: must be 1 to 40 hex digits (a certificate serial is 20 bytes)")
    try:
        return int(cleaned, 16)
    except ValueError:
        raise Invalid(f"serial: {text[:64]!r} is not a hexadecimal number") from None


def serial_of(dir: Path | str, role: str, name: str) -> int:
    """The serial of the certificate `orka certs` issued to (role, name) in `dir`."""
    try:
        files = TlsFiles.for_service(dir, role, name)
    except Invalid as e:
        raise NotFound(e.message) from None
    try:
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    except ValueError as e:
        raise Invalid(f"certs: {files.cert} is not a PEM certificate: {e}") from None
    return cert.serial_number


def current_crl(dir: Path | str) -> x509.CertificateRevocationList | None:
    """The CRL in `dir`, checked against the CA; None when nothing was revoked yet."""
    dir = Path(dir)
    path = dir / CRL_FILE
    if not path.is_file():
        return None
    ca = load_ca(dir)
    return parse_crl(path.read_bytes(), ca.cert, str(path))


def revoke(
    dir: Path | str, serials: Iterable[int], now: dt.datetime | None = None
) -> tuple[list[int], list[Path]]:
    """Add `serials` to the CRL; returns the serials newly revoked and the files written."""
    dir = Path(dir)
    ca = load_ca(dir)
    now = now or dt.datetime.now(dt.UTC)
    previous = current_crl(dir)
    entries = {e.serial_number: e for e in previous} if previous is not None else {}
    new = [s for s in dict.fromkeys(serials) if s not in entries]
    if previous is not None and not new:
        # Nothing to add: re-publish the same CRL (a folder made since may lack it).
        return [], publish(dir, previous.public_bytes(serialization.Encoding.PEM))
    number = crl_number(previous) + 1 if previous is not None else 1
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(now)
        .next_update(now + CRL_NEXT_UPDATE)
        .add_extension(x509.CRLNumber(number), critical=False)
    )
    for entry in entries.values():
        builder = builder.add_revoked_certificate(entry)
    for serial in new:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    crl = builder.sign(ca.key, hashes.SHA256())
    return new, publish(dir, crl.public_bytes(serialization.Encoding.PEM))


def publish(dir: Path, pem: bytes) -> list[Path]:
    """Write the CRL atomically on top and into each service folder (what each one reads)."""
    written = []
    for folder in [dir, *service_folders(dir)]:
        write_public(folder / CRL_FILE, pem)
        written.append(folder / CRL_FILE)
    return written
