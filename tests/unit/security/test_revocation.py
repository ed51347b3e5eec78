from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography import x509
from structlog.testing import capture_logs

from orka.errors import Invalid, NotFound, Unauthenticated
from orka.security.issue import init_certs, issue_cert
from orka.security.revocation import MAX_CRL_BYTES, CrlWatcher, Revocations
from orka.security.revoke import current_crl, parse_serial, revoke, serial_of


def _watcher(certs: Path, folder: str = "controller") -> CrlWatcher:
    own = certs / folder
    return CrlWatcher(own / "crl.pem", own / "ca.crt", interval=1.0, registry=Revocations())


def _replace(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    st = path.stat()
    # A new mtime even within the filesystem's timestamp granularity.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_revoke_writes_a_ca_signed_crl_everywhere(certs: Path) -> None:
    admin = serial_of(certs, "admin", "admin")
    new, written = revoke(certs, [admin])
    assert new == [admin]
    folders = ["", "agent-node-1", "controller", "scheduler"]
    assert set(written) == {certs / f / "crl.pem" for f in folders}
    pem = (certs / "crl.pem").read_bytes()
    for f in folders:
        assert (certs / f / "crl.pem").read_bytes() == pem
    crl = current_crl(certs)
    assert crl is not None and [e.serial_number for e in crl] == [admin]


def test_revoke_accumulates_and_is_idempotent(certs: Path) -> None:
    a, b = serial_of(certs, "admin", "admin"), serial_of(certs, "agent", "node-1")
    revoke(certs, [a])
    first = current_crl(certs)
    assert revoke(certs, [b])[0] == [b]
    assert revoke(certs, [a, b])[0] == []
    crl = current_crl(certs)
    assert crl is not None and first is not None
    assert {e.serial_number for e in crl} == {a, b}
    number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    assert number == first.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number + 1


def test_revoke_refuses_to_build_on_a_crl_the_ca_did_not_sign(certs: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    init_certs(other)
    revoke(other, [1])
    shutil.copy(other / "crl.pem", certs / "crl.pem")
    with pytest.raises(Invalid, match="not signed by the cluster CA"):
        revoke(certs, [2])


def test_serial_of_unknown_identity_is_not_found(certs: Path) -> None:
    with pytest.raises(NotFound, match="agent-node-9"):
        serial_of(certs, "agent", "node-9")


@pytest.mark.parametrize(
    ("text", "serial"),
    [("1f", 0x1F), ("0x1F", 0x1F), ("07:62:C3", 0x0762C3), (" abc ", 0xABC)],
)
def test_parse_serial(text: str, serial: int) -> None:
    assert parse_serial(text) == serial


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "1 to 40 hex digits"), ("zz", "not a hexadecimal"), ("f" * 41, "1 to 40 hex digits")],
)
def test_parse_serial_refuses(text: str, message: str) -> None:
    with pytest.raises(Invalid, match=message) as info:
        parse_serial(text)
    assert len(info.value.message) < 120  # never echoes unbounded input


def test_watcher_loads_a_crl_and_refuses_the_revoked_serial(certs: Path) -> None:
    watcher = _watcher(certs)
    watcher.load()  # no CRL yet: nothing revoked, nothing logged as an error
    admin = serial_of(certs, "admin", "admin")
    assert not watcher.registry.is_revoked(admin)
    revoke(certs, [admin])
    watcher.load()
    assert watcher.registry.is_revoked(admin)
    assert not watcher.registry.is_revoked(serial_of(certs, "agent", "node-1"))


BAD_CRLS: list[tuple[str, Any, str]] = [
    ("garbage", lambda certs, other: b"not a crl", "is not a PEM certificate revocation list"),
    ("truncated", lambda certs, other: (certs / "crl.pem").read_bytes()[:120], "is not a PEM"),
    (
        "other CA, same CA name",
        lambda certs, other: (other / "crl.pem").read_bytes(),
        "is not signed by the cluster CA",
    ),
    ("oversized", lambda certs, other: b"x" * (MAX_CRL_BYTES + 1), "over the"),
]


@pytest.mark.parametrize(("case", "make", "reason"), BAD_CRLS, ids=[c[0] for c in BAD_CRLS])
def test_a_bad_crl_is_refused_and_the_previous_one_kept(
    certs: Path, tmp_path: Path, case: str, make: Any, reason: str
) -> None:
    other = tmp_path / "other"
    init_certs(other)
    revoke(other, [serial_of(other, "admin", "admin")])  # an empty-handed forgery: un-revokes
    admin = serial_of(certs, "admin", "admin")
    revoke(certs, [admin])
    watcher = _watcher(certs)
    watcher.load()
    assert watcher.registry.is_revoked(admin)

    _replace(watcher.crl, make(certs, other))
    with capture_logs() as logs:
        watcher.load()
    assert watcher.registry.is_revoked(admin), case
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1, logs
    assert errors[0]["event"] == "crl rejected; keeping the previous one"
    assert reason in errors[0]["reason"]
    assert str(watcher.crl) in errors[0]["reason"]
    # Logged once per bad file, not on every tick.
    with capture_logs() as logs:
        watcher.load()
    assert logs == []

    # A good CRL after the bad one is taken again.
    node = serial_of(certs, "agent", "node-1")
    revoke(certs, [node])  # builds on certs/crl.pem, which stayed good
    watcher.load()
    assert watcher.registry.is_revoked(node) and watcher.registry.is_revoked(admin)


def test_a_deleted_crl_does_not_reinstate_a_key(certs: Path) -> None:
    admin = serial_of(certs, "admin", "admin")
    revoke(certs, [admin])
    watcher = _watcher(certs)
    watcher.load()
    watcher.crl.unlink()
    watcher.load()
    assert watcher.registry.is_revoked(admin)


def test_issue_gives_a_new_folder_the_current_crl(certs: Path) -> None:
    revoke(certs, [serial_of(certs, "admin", "admin")])
    issue_cert(certs, "agent", "node-5")
    assert (certs / "agent-node-5" / "crl.pem").read_bytes() == (certs / "crl.pem").read_bytes()


def _context(pem: bytes) -> Any:
    return SimpleNamespace(auth_context=lambda: {"x509_pem_cert": [pem]})


def test_admit_refuses_only_revoked_serials(certs: Path) -> None:
    registry = Revocations()
    admin_pem = (certs / "admin.crt").read_bytes()
    node_pem = (certs / "agent-node-1" / "agent-node-1.crt").read_bytes()
    registry.admit(admin_pem, _context(admin_pem))
    registry.update(certs / "crl.pem", frozenset({serial_of(certs, "admin", "admin")}))
    with pytest.raises(Unauthenticated, match=r"^certificate revoked$"):
        registry.admit(admin_pem, _context(admin_pem))
    registry.admit(node_pem, _context(node_pem))


def test_an_older_crl_is_refused(certs: Path) -> None:
    # A CA-signed CRL from before the last revocation: putting it back would un-revoke.
    admin = serial_of(certs, "admin", "admin")
    revoke(certs, [admin])
    older = (certs / "controller" / "crl.pem").read_bytes()
    node = serial_of(certs, "agent", "node-1")
    revoke(certs, [node])
    watcher = _watcher(certs)
    watcher.load()
    _replace(watcher.crl, older)
    with capture_logs() as logs:
        watcher.load()
    assert watcher.registry.is_revoked(node) and watcher.registry.is_revoked(admin)
    assert [e["event"] for e in logs] == ["crl rejected; keeping the previous one"]
    assert "is number 1, older than the one in force (2)" in logs[0]["reason"]
