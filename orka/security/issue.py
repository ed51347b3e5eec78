"""The certs directory layout: `ca.crt`/`ca.key` plus `<stem>.crt`/`<stem>.key` per identity."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from orka.errors import Invalid
from orka.security.ca import (
    LEAF_DAYS,
    SERVING_ROLES,
    CertificateAuthority,
    cert_pem,
    create_ca,
    issue_leaf,
    key_pem,
    split_hosts,
    validate_name,
    validate_role,
)

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
# These roles normally have one instance per cluster, so their files drop the name suffix.
_SINGLETON_ROLES = frozenset({"admin", "controller", "scheduler"})


def cert_stem(role: str, name: str) -> str:
    if role in _SINGLETON_ROLES and name == role:
        return role
    return f"{role}-{name}"


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    # Write-then-rename so an interrupted run never leaves a truncated PEM that a resumed
    # run would mistake for a finished file; the temp file is created with the final mode
    # so a key is never readable by others, even briefly.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _write_pair(
    dir: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> list[Path]:
    key_path, crt_path = dir / f"{stem}.key", dir / f"{stem}.crt"
    # Key first: the .crt appearing is what marks the pair complete.
    _write_atomic(key_path, key_pem(key), 0o600)
    _write_atomic(crt_path, cert_pem(cert), 0o644)
    return [crt_path, key_path]


def load_ca(dir: Path | str) -> CertificateAuthority:
    dir = Path(dir)
    crt_path, key_path = dir / CA_CERT, dir / CA_KEY
    for p in (crt_path, key_path):
        if not p.is_file():
            raise Invalid(f"certs: CA file {p} does not exist (run `orka certs init --dir {dir}`)")
    try:
        cert = x509.load_pem_x509_certificate(crt_path.read_bytes())
    except ValueError as e:
        raise Invalid(f"certs: {crt_path} is not a PEM certificate: {e}") from None
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise Invalid(f"certs: {key_path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise Invalid(f"certs: {key_path} is not an ECDSA key")
    if key.public_key() != cert.public_key():
        raise Invalid(f"certs: {key_path} does not match {crt_path}")
    return CertificateAuthority(cert=cert, key=key)


def _ensure_ca(dir: Path) -> tuple[CertificateAuthority, list[Path]]:
    crt_path, key_path = dir / CA_CERT, dir / CA_KEY
    if crt_path.exists() or key_path.exists():
        # Never replace a CA: every cert already handed out would stop verifying.
        return load_ca(dir), []
    ca = create_ca()
    _write_atomic(key_path, key_pem(ca.key), 0o600)
    _write_atomic(crt_path, cert_pem(ca.cert), 0o644)
    return ca, [crt_path, key_path]


def init_certs(
    dir: Path | str, nodes: Iterable[str] = (), extra_hosts: Iterable[str] = ()
) -> list[Path]:
    """Create the CA and the controller, scheduler, admin and per-node agent certs.

    Existing files are kept, so a re-run resumes an interrupted one. Returns the paths written.
    """
    dir = Path(dir)
    nodes, extra_hosts = list(nodes), list(extra_hosts)
    # Validate everything before writing anything, so a typo does not leave a half-made dir.
    for node in nodes:
        validate_name(node)
    split_hosts(extra_hosts)  # a malformed or reserved --host fails before anything is written
    dir.mkdir(parents=True, exist_ok=True)
    ca, written = _ensure_ca(dir)
    wanted = [("controller", "controller"), ("scheduler", "scheduler"), ("admin", "admin")]
    wanted += [("agent", node) for node in nodes]
    for role, name in wanted:
        stem = cert_stem(role, name)
        if (dir / f"{stem}.crt").exists() and (dir / f"{stem}.key").exists():
            continue
        leaf = issue_leaf(ca, role, name, extra_hosts if role in SERVING_ROLES else ())
        written += _write_pair(dir, stem, leaf.cert, leaf.key)
    return written


def issue_cert(
    dir: Path | str,
    role: str,
    name: str,
    hosts: Iterable[str] = (),
    *,
    days: int = LEAF_DAYS,
    not_valid_before: dt.datetime | None = None,
    not_valid_after: dt.datetime | None = None,
) -> list[Path]:
    """Issue (or re-issue, overwriting) one cert from the CA in `dir`; returns [crt, key]."""
    validate_role(role)
    validate_name(name)
    dir = Path(dir)
    ca = load_ca(dir)
    leaf = issue_leaf(
        ca,
        role,
        name,
        hosts,
        days=days,
        not_valid_before=not_valid_before,
        not_valid_after=not_valid_after,
    )
    return _write_pair(dir, cert_stem(role, name), leaf.cert, leaf.key)
