"""The certs directory layout, least privilege first.

    DIR/                      0700  what the CLI and grpcurl use, and nothing a service needs
      ca.crt admin.crt admin.key [crl.pem]
      ca/ca.key               0700 folder: only `orka certs` reads it; no service is given it
      controller/             0700, one per service: ca.crt + its own pair [+ crl.pem]
        ca.crt controller.crt controller.key
      scheduler/  agent-<node>/  ...

A service is handed its own folder (`--certs DIR/agent-node-1`) and so can read no other key;
`TlsFiles.for_service` also finds the pair from `--certs DIR`. Older flat dirs (every pair and
`ca.key` side by side in DIR) are still read, and `init_certs` moves them to this layout.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from orka.errors import Invalid
from orka.filemodes import PRIVATE_DIR as DIR_MODE
from orka.filemodes import PRIVATE_FILE as KEY_MODE
from orka.filemodes import private_dir
from orka.security.ca import (
    ROLES,
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
CA_DIR = "ca"
CRL_FILE = "crl.pem"
CERT_MODE = 0o644
# 90 days: a copied key is useful to a thief for at most a quarter, and rotation is one
# command (`orka certs rotate`, or `orka up` at start), so short costs little. Revocation
# covers the time in between.
DEFAULT_DAYS = 90
# These roles normally have one instance per cluster, so their files drop the name suffix.
_SINGLETON_ROLES = frozenset({"admin", "controller", "scheduler"})
# People at a terminal: their pairs stay at the top of DIR (the CLI's `--certs DIR`).
_TOP_LEVEL_ROLES = frozenset({"admin", "viewer"})


def cert_stem(role: str, name: str) -> str:
    if role in _SINGLETON_ROLES and name == role:
        return role
    return f"{role}-{name}"


def role_of_stem(stem: str) -> str | None:
    """The role a file stem was written for, or None when it is not one of ours."""
    role = stem.split("-", 1)[0]
    return role if role in ROLES else None


def pair_dir(dir: Path, role: str, name: str) -> Path:
    """Where `orka certs` keeps the pair of (role, name) inside the certs dir `dir`."""
    if role in _TOP_LEVEL_ROLES:
        return dir
    return dir / cert_stem(role, name)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    # Write-then-rename so an interrupted run never leaves a truncated PEM that a resumed
    # run would mistake for a finished file (and a running server re-reading it never sees
    # half a file); the temp file is created with the final mode so a key is never readable
    # by others, even briefly.
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
    os.chmod(tmp, mode)  # O_CREAT's mode is masked by the umask; the final one is not
    os.replace(tmp, path)


def write_public(path: Path, data: bytes) -> None:
    """Atomically write a certificate or CRL (0644: its folder's 0700 is what guards it)."""
    _write_atomic(path, data, CERT_MODE)


def write_pair(
    dir: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> list[Path]:
    key_path, crt_path = dir / f"{stem}.key", dir / f"{stem}.crt"
    # Key first: the .crt appearing is what marks the pair complete.
    _write_atomic(key_path, key_pem(key), KEY_MODE)
    _write_atomic(crt_path, cert_pem(cert), CERT_MODE)
    return [crt_path, key_path]


def ca_key_path(dir: Path | str) -> Path:
    """The CA key: `DIR/ca/ca.key`, or flat `DIR/ca.key` in a dir from before the split."""
    dir = Path(dir)
    split = dir / CA_DIR / CA_KEY
    flat = dir / CA_KEY
    return flat if flat.is_file() and not split.exists() else split


def load_ca(dir: Path | str) -> CertificateAuthority:
    dir = Path(dir)
    crt_path, key_path = dir / CA_CERT, ca_key_path(dir)
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
    crt_path = dir / CA_CERT
    split_key, flat_key = dir / CA_DIR / CA_KEY, dir / CA_KEY
    if flat_key.is_file() and not split_key.exists():
        # A dir from before the split: move the key where no service is handed it. Same key,
        # same CA, so nothing already issued stops verifying.
        private_dir(split_key.parent)
        os.replace(flat_key, split_key)
        os.chmod(split_key, KEY_MODE)
        return load_ca(dir), [split_key]
    if crt_path.exists() or split_key.exists():
        # Never replace a CA: every cert already handed out would stop verifying.
        return load_ca(dir), []
    ca = create_ca()
    private_dir(split_key.parent)
    _write_atomic(split_key, key_pem(ca.key), KEY_MODE)
    _write_atomic(crt_path, cert_pem(ca.cert), CERT_MODE)
    return ca, [crt_path, split_key]


def sync_shared(dir: Path, folder: Path) -> list[Path]:
    """Give a service folder the current `ca.crt` (and `crl.pem`) of the certs dir."""
    written = []
    for name in (CA_CERT, CRL_FILE):
        src = dir / name
        if not src.is_file():
            continue
        data = src.read_bytes()
        dst = folder / name
        if not dst.is_file() or dst.read_bytes() != data:
            write_public(dst, data)
            written.append(dst)
    return written


def _migrate_flat_pairs(dir: Path) -> list[Path]:
    """Move each service pair lying flat in `dir` into its own folder (same files, same keys)."""
    moved = []
    for crt in sorted(dir.glob("*.crt")):
        stem = crt.stem
        role = role_of_stem(stem)
        key = crt.with_suffix(".key")
        if stem == "ca" or role is None or role in _TOP_LEVEL_ROLES or not key.is_file():
            continue
        folder = private_dir(dir / stem)
        if (folder / crt.name).exists():
            continue  # already moved once; never overwrite what the folder holds
        # Key first, like `write_pair`: a folder with a .crt always has its key.
        os.replace(key, folder / key.name)
        os.replace(crt, folder / crt.name)
        moved += [folder / crt.name, folder / key.name]
    return moved


def service_folders(dir: Path) -> list[Path]:
    """Every service folder in the certs dir `dir` (each holds its own `ca.crt`)."""
    return sorted(
        p
        for p in dir.iterdir()
        if p.is_dir() and p.name != CA_DIR and role_of_stem(p.name) is not None
    )


def _tighten_modes(dir: Path) -> None:
    # Dirs made before the split were 0755 with 0644 certs: keys and folders are closed now.
    os.chmod(dir, DIR_MODE)
    for folder in [dir, *service_folders(dir), dir / CA_DIR]:
        if not folder.is_dir():
            continue
        os.chmod(folder, DIR_MODE)
        for key in folder.glob("*.key"):
            os.chmod(key, KEY_MODE)


def init_certs(
    dir: Path | str,
    nodes: Iterable[str] = (),
    extra_hosts: Iterable[str] = (),
    *,
    days: int = DEFAULT_DAYS,
) -> list[Path]:
    """Create the CA and the controller, scheduler, admin and per-node agent certs.

    Existing files are kept, so a re-run resumes an interrupted one; a flat dir from before
    the split is moved to the per-service layout (never re-issued). Returns the paths written.
    """
    dir = Path(dir)
    nodes, extra_hosts = list(nodes), list(extra_hosts)
    # Validate everything before writing anything, so a typo does not leave a half-made dir.
    for node in nodes:
        validate_name(node)
    split_hosts(extra_hosts)  # a malformed or reserved --host fails before anything is written
    private_dir(dir)
    ca, written = _ensure_ca(dir)
    written += _migrate_flat_pairs(dir)
    wanted = [("controller", "controller"), ("scheduler", "scheduler"), ("admin", "admin")]
    wanted += [("agent", node) for node in nodes]
    for role, name in wanted:
        stem = cert_stem(role, name)
        folder = pair_dir(dir, role, name)
        if folder != dir:
            private_dir(folder)
        if not ((folder / f"{stem}.crt").exists() and (folder / f"{stem}.key").exists()):
            # Host names belong in server certificates only.
            hosts = extra_hosts if role in SERVING_ROLES else ()
            leaf = issue_leaf(ca, role, name, hosts, days=days)
            written += write_pair(folder, stem, leaf.cert, leaf.key)
    for folder in service_folders(dir):
        written += sync_shared(dir, folder)
    _tighten_modes(dir)
    return written


def issue_cert(
    dir: Path | str,
    role: str,
    name: str,
    hosts: Iterable[str] = (),
    *,
    days: int = DEFAULT_DAYS,
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
    folder = pair_dir(dir, role, name)
    if folder != dir:
        private_dir(folder)
        sync_shared(dir, folder)
    return write_pair(folder, cert_stem(role, name), leaf.cert, leaf.key)
