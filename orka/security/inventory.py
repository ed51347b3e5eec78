"""`orka certs list`: what a certs dir holds, each certificate with its serial, expiry and
whether the dir's CRL revokes it."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from pydantic import BaseModel

from orka.errors import Invalid, Unauthenticated
from orka.security.identity import identity_from_cert
from orka.security.issue import role_of_stem
from orka.security.revocation import serials_of
from orka.security.revoke import current_crl
from orka.security.rotate import issued_pairs


class CertInfo(BaseModel):
    role: str
    name: str
    serial: str  # hex, as `orka certs revoke --serial` and `openssl x509 -serial` take it
    not_after: dt.datetime
    revoked: bool
    expired: bool
    path: str


def list_certs(dir: Path | str, now: dt.datetime | None = None) -> list[CertInfo]:
    """Every pair `orka certs` keeps in `dir` (the CA excluded), in the order they are found."""
    dir = Path(dir)
    if not dir.is_dir():
        raise Invalid(f"certs: {dir} is not a directory")
    now = now or dt.datetime.now(dt.UTC)
    crl = current_crl(dir)
    revoked = serials_of(crl) if crl is not None else frozenset()
    infos = []
    for pair in issued_pairs(dir):
        try:
            who = identity_from_cert(pair.cert)
            role, name = who.role, who.name
        except Unauthenticated:
            # Not one of ours after all (no role URI): listed, but named by its file.
            role, name = role_of_stem(pair.stem) or "?", "?"
        infos.append(
            CertInfo(
                role=role,
                name=name,
                serial=format(pair.cert.serial_number, "x"),
                not_after=pair.cert.not_valid_after_utc,
                revoked=pair.cert.serial_number in revoked,
                expired=pair.cert.not_valid_after_utc < now,
                path=str(pair.cert_path),
            )
        )
    return infos
