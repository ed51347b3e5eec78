"""The certs directory kept as it should be: a CA never replaced, flat pairs moved once and
never over a folder's, modes tightened on every run, the CA's files named when they are bad."""

from __future__ import annotations

import datetime as dt
import shutil
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from orka.errors import Invalid
from orka.security.issue import init_certs, issue_cert, load_ca


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_a_ca_certificate_without_its_key_is_never_replaced(tmp_path: Path) -> None:
    """A folder holding only the CA certificate (a service's copy, say): making a new CA there
    would leave every certificate issued so far unverifiable."""
    d = tmp_path / "certs"
    init_certs(d)
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(d / "ca.crt", copy / "ca.crt")
    with pytest.raises(Invalid) as info:
        init_certs(copy)
    assert info.value.message == (
        f"certs: CA file {copy / 'ca' / 'ca.key'} does not exist "
        f"(run `orka certs init --dir {copy}`)"
    )
    assert (copy / "ca.crt").read_bytes() == (d / "ca.crt").read_bytes()


def test_flat_pairs_are_moved_past_one_already_moved(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    init_certs(d, ["node-1"])
    pairs = {
        stem: {ext: (d / stem / f"{stem}.{ext}").read_bytes() for ext in ("crt", "key")}
        for stem in ("agent-node-1", "controller", "scheduler")
    }
    # agent-node-1 (first in name order) already has its pair in its folder, and a stale flat
    # copy beside it; the controller's and scheduler's lie flat only.
    for stem in ("agent-node-1", "controller", "scheduler"):
        for ext in ("crt", "key"):
            shutil.copy(d / stem / f"{stem}.{ext}", d / f"{stem}.{ext}")
    for stem in ("controller", "scheduler"):
        shutil.rmtree(d / stem)
    written = init_certs(d, ["node-1"])
    moved = {str(p.relative_to(d)) for p in written if p.name != "ca.crt"}
    assert moved == {
        f"{s}/{s}.{ext}" for s in ("controller", "scheduler") for ext in ("crt", "key")
    }
    for stem, files in pairs.items():
        for ext, data in files.items():
            assert (d / stem / f"{stem}.{ext}").read_bytes() == data  # moved, not re-issued
    # The stale flat copy of a pair already moved is left alone, never moved over it.
    assert (d / "agent-node-1.crt").is_file()
    assert not (d / "controller.crt").exists()


def test_every_run_closes_folders_and_keys_opened_since(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    init_certs(d, ["node-1"])
    opened = [d / "controller", d / "agent-node-1", d / "ca"]
    keys = [d / "controller" / "controller.key", d / "ca" / "ca.key", d / "admin.key"]
    for p in opened:
        p.chmod(0o755)
    for p in keys:
        p.chmod(0o644)
    assert init_certs(d, ["node-1"]) == []
    assert [_mode(p) for p in opened] == [0o700] * 3
    assert [_mode(p) for p in keys] == [0o600] * 3


def _lifetime(crt: Path) -> dt.timedelta:
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    return cert.not_valid_after_utc - cert.not_valid_before_utc


def test_certificates_are_issued_for_the_days_asked(tmp_path: Path) -> None:
    init_certs(tmp_path, ["node-1"], days=20)
    for crt in ("admin.crt", "controller/controller.crt", "agent-node-1/agent-node-1.crt"):
        assert _lifetime(tmp_path / crt) == dt.timedelta(days=20)
    crt, _ = issue_cert(tmp_path, "agent", "node-9", days=10)
    assert _lifetime(crt) == dt.timedelta(days=10)


def test_each_bad_ca_file_is_named(tmp_path: Path) -> None:
    init_certs(tmp_path)
    crt, key = tmp_path / "ca.crt", tmp_path / "ca" / "ca.key"
    good_crt, good_key = crt.read_bytes(), key.read_bytes()

    crt.write_bytes(b"junk")
    with pytest.raises(Invalid) as info:
        load_ca(tmp_path)
    assert info.value.message.startswith(f"certs: {crt} is not a PEM certificate: ")
    crt.write_bytes(good_crt)

    key.write_bytes(b"junk")
    with pytest.raises(Invalid) as info:
        load_ca(tmp_path)
    assert info.value.message.startswith(f"certs: {key} is not an unencrypted PEM private key: ")

    key.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(Invalid) as info:
        load_ca(tmp_path)
    assert info.value.message == f"certs: {key} is not an ECDSA key"

    other = tmp_path / "other"
    init_certs(other)
    key.write_bytes((other / "ca" / "ca.key").read_bytes())
    with pytest.raises(Invalid) as info:
        load_ca(tmp_path)
    assert info.value.message == f"certs: {key} does not match {crt}"
    key.write_bytes(good_key)
    assert load_ca(tmp_path).cert.subject.rfc4514_string() == "CN=orka cluster CA"
