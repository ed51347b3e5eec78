"""`orka certs rotate`: re-issue certificates in place (new key, same identity and names).

Servers serve the new pair from their next handshake (`tls.ServerCertificates`); clients use it
when they next connect. The CA is never rotated here: that would invalidate every certificate.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from orka.errors import Invalid, NotFound
from orka.filemodes import private_dir
from orka.security.ca import SERVING_ROLES, issue_leaf
from orka.security.identity import identity_from_cert, names_role
from orka.security.issue import (
    CA_DIR,
    DEFAULT_DAYS,
    cert_stem,
    load_ca,
    role_of_stem,
    sync_shared,
    write_pair,
)
from orka.security.tls import due_for_renewal


@dataclass(frozen=True)
class Pair:
    """One issued pair in a certs dir, as found on disk."""

    cert_path: Path
    cert: x509.Certificate

    @property
    def stem(self) -> str:
        return self.cert_path.stem


def _load(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as e:
        raise Invalid(f"certs: {path} is not a PEM certificate: {e}") from None


def issued_pairs(dir: Path) -> list[Pair]:
    """Every pair `orka certs` keeps in `dir`: the admins' on top, the services' in folders."""
    found = []
    for folder in [dir, *sorted(p for p in dir.iterdir() if p.is_dir() and p.name != CA_DIR)]:
        for crt in sorted(folder.glob("*.crt")):
            if crt.stem != "ca" and role_of_stem(crt.stem) and crt.with_suffix(".key").is_file():
                found.append(Pair(crt, _load(crt)))
    return found


# Names under `.orka` name a server's role (`controller.orka`); issue_leaf adds them itself
# and refuses them from callers, so they are not carried over as hosts.
_ROLE_DOMAIN = "orka"


def _hosts(cert: x509.Certificate) -> list[str]:
    """The host names and IPs a server certificate serves, to keep them on re-issue."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    dns = [
        d
        for d in san.get_values_for_type(x509.DNSName)
        if d.rstrip(".") != _ROLE_DOMAIN and not d.rstrip(".").endswith("." + _ROLE_DOMAIN)
    ]
    return [*dns, *map(str, san.get_values_for_type(x509.IPAddress))]


def rotate(
    dir: Path | str,
    *,
    role: str | None = None,
    name: str | None = None,
    only_due: bool = False,
    days: int = DEFAULT_DAYS,
    now: dt.datetime | None = None,
) -> list[Path]:
    """Re-issue (role, name), or every pair when role is None; returns the files written.

    `only_due` re-issues only certificates due for renewal (what `orka up` does at start).
    """
    dir = Path(dir)
    ca = load_ca(dir)
    pairs = issued_pairs(dir)
    if role is not None:
        if name is None:
            raise Invalid("name: is required with role")
        want = cert_stem(role, name)
        pairs = [p for p in pairs if p.stem == want]
        if not pairs:
            raise NotFound(f"certs: no {role} certificate named {name!r} in {dir}")
    written: list[Path] = []
    for pair in pairs:
        ident = identity_from_cert(pair.cert)
        # A server certificate from before role names would be refused by every client.
        stale = ident.role in SERVING_ROLES and not names_role(pair.cert, ident.role)
        if only_due and not (stale or due_for_renewal(pair.cert, now)):
            continue
        # A server keeps the names it serves; a client certificate is issued without any.
        hosts = _hosts(pair.cert) if ident.role in SERVING_ROLES else []
        leaf = issue_leaf(ca, ident.role, ident.name, hosts, days=days)
        folder = pair.cert_path.parent
        if folder != dir:
            private_dir(folder)
            sync_shared(dir, folder)
        written += write_pair(folder, pair.stem, leaf.cert, leaf.key)
    return written
