"""Certificates made by hand, in shapes `orka certs` never issues: no Orka identity, reserved
names spelled with a trailing dot, an operator's foreign pair, a CA with a key that cannot
verify anything."""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import NameOID


def handmade(
    subject: str | x509.Name,
    public_key: CertificatePublicKeyTypes,
    signer: ec.EllipticCurvePrivateKey,
    issuer: x509.Name | None = None,
    *,
    sans: list[x509.GeneralName] | None = None,
    serial: int | None = None,
    start: dt.datetime | None = None,
    days: float = 2,
) -> x509.Certificate:
    """A certificate for `public_key` signed by `signer` as `issuer` (None: self-issued),
    with a subjectAltName only when `sans` is given; valid from a day ago unless `start`."""
    name = (
        subject
        if isinstance(subject, x509.Name)
        else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    )
    begin = start or dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(public_key)
        .serial_number(serial if serial is not None else x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(begin + dt.timedelta(days=days))
    )
    if sans is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signer, hashes.SHA256())
