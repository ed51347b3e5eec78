from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from cryptography import x509

from orka.errors import Invalid
from orka.security.issue import cert_stem, init_certs, issue_cert
from orka.security.tls import TlsFiles, load_and_check


@pytest.mark.parametrize(
    ("role", "name", "stem"),
    [
        ("admin", "admin", "admin"),
        ("controller", "controller", "controller"),
        ("scheduler", "scheduler", "scheduler"),
        ("agent", "node-1", "agent-node-1"),
        ("agent", "agent", "agent-agent"),
        ("controller", "c2", "controller-c2"),
        ("admin", "alice", "admin-alice"),
    ],
)
def test_cert_stem(role: str, name: str, stem: str) -> None:
    assert cert_stem(role, name) == stem


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


SERVICES = ["controller", "scheduler", "agent-node-1", "agent-node-2"]


def test_init_certs_layout_and_modes(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    written = init_certs(d, ["node-1", "node-2"], ["api.example.com"])
    expected = {"ca.crt", "ca/ca.key", "admin.crt", "admin.key"}
    for s in SERVICES:
        expected |= {f"{s}/ca.crt", f"{s}/{s}.crt", f"{s}/{s}.key"}
    assert {str(p.relative_to(d)) for p in written} == expected
    assert set(_snapshot(d)) == expected  # no temp files, nothing else anywhere
    # Least privilege: only the owner can enter any folder or read any key.
    assert _mode(d) == 0o700
    assert _mode(d / "ca") == 0o700
    assert _mode(d / "ca" / "ca.key") == 0o600
    assert _mode(d / "admin.key") == 0o600
    for s in SERVICES:
        assert _mode(d / s) == 0o700
        assert _mode(d / s / f"{s}.key") == 0o600
        assert (d / s / "ca.crt").read_bytes() == (d / "ca.crt").read_bytes()
    for role, name in [("admin", "admin"), ("agent", "node-2"), ("controller", "controller")]:
        ident = load_and_check(TlsFiles.for_service(d, role, name))
        assert (ident.role, ident.name) == (role, name)
    # --host goes into server certificates only.
    assert "api.example.com" in _dns(d / "controller" / "controller.crt")
    assert _dns(d / "admin.crt") == []


def _dns(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName)


def test_init_certs_modes_despite_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        init_certs(tmp_path / "c", ["node-1"])
    finally:
        os.umask(old)
    assert _mode(tmp_path / "c" / "agent-node-1" / "agent-node-1.crt") == 0o644
    assert _mode(tmp_path / "c" / "agent-node-1" / "agent-node-1.key") == 0o600


def _flatten(d: Path) -> None:
    """Turn a dir into the pre-split layout: every file flat in d, folders 0755."""
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.parent != d:
            if p.name == "ca.crt":
                p.unlink()
            else:
                p.rename(d / p.name)
    for p in d.iterdir():
        if p.is_dir():
            p.rmdir()
    d.chmod(0o755)


def test_init_certs_moves_a_flat_dir_without_reissuing(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    init_certs(d, ["node-1"])
    _flatten(d)
    flat = _snapshot(d)
    assert set(flat) >= {"ca.key", "agent-node-1.key", "controller.crt"}
    # An old flat dir still works as is: issue finds the flat CA key, services their pair.
    issue_cert(d, "agent", "node-3")
    assert load_and_check(TlsFiles.for_service(d, "agent", "node-1")).name == "node-1"

    init_certs(d, ["node-1", "node-2"])
    now = _snapshot(d)
    assert _mode(d) == 0o700
    assert "ca.key" not in now and now["ca/ca.key"] == flat["ca.key"]
    assert now["ca.crt"] == flat["ca.crt"]  # never a new CA
    for s in ["controller", "scheduler", "agent-node-1"]:
        assert now[f"{s}/{s}.key"] == flat[f"{s}.key"]
        assert now[f"{s}/{s}.crt"] == flat[f"{s}.crt"]
        assert f"{s}.key" not in now
        assert _mode(d / s) == 0o700
    assert "agent-node-2/agent-node-2.crt" in now
    assert "agent-node-3/agent-node-3.key" in now
    assert now["admin.key"] == flat["admin.key"]
    load_and_check(TlsFiles.for_service(d, "agent", "node-3"))


def test_init_certs_idempotent_and_resumes(tmp_path: Path) -> None:
    init_certs(tmp_path, ["node-1"])
    before = _snapshot(tmp_path)
    assert init_certs(tmp_path, ["node-1"]) == []
    assert _snapshot(tmp_path) == before

    # A run interrupted before the scheduler pair and a new node: only those are added,
    # signed by the existing CA.
    (tmp_path / "scheduler" / "scheduler.crt").unlink()
    written = init_certs(tmp_path, ["node-1", "node-2"])
    assert {str(p.relative_to(tmp_path)) for p in written} == {
        "scheduler/scheduler.crt",
        "scheduler/scheduler.key",
        "agent-node-2/agent-node-2.crt",
        "agent-node-2/agent-node-2.key",
        "agent-node-2/ca.crt",
    }
    after = _snapshot(tmp_path)
    for name in ("ca.crt", "ca/ca.key", "admin.crt", "agent-node-1/agent-node-1.key"):
        assert after[name] == before[name]
    load_and_check(TlsFiles.for_service(tmp_path, "scheduler", "scheduler"))


def test_init_certs_bad_node_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(Invalid, match=r"^name:"):
        init_certs(tmp_path / "c", ["ok", "Not_OK"])
    assert not (tmp_path / "c").exists()


def test_issue_cert(tmp_path: Path) -> None:
    init_certs(tmp_path, [])
    paths = issue_cert(tmp_path, "agent", "node-9")
    folder = tmp_path / "agent-node-9"
    assert paths == [folder / "agent-node-9.crt", folder / "agent-node-9.key"]
    assert (folder / "ca.crt").read_bytes() == (tmp_path / "ca.crt").read_bytes()
    assert _mode(folder) == 0o700
    assert issue_cert(tmp_path, "admin", "alice")[0] == tmp_path / "admin-alice.crt"
    ident = load_and_check(TlsFiles.for_service(tmp_path, "agent", "node-9"))
    assert ident.uri == "spiffe://orka/agent/node-9"
    issue_cert(tmp_path, "viewer", "alice")
    ident = load_and_check(TlsFiles.for_service(tmp_path, "viewer", "alice"))
    assert ident.uri == "spiffe://orka/viewer/alice"


def _names(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(g.value) for g in san]


def test_issue_cert_hosts_only_for_servers(tmp_path: Path) -> None:
    init_certs(tmp_path, [])
    before = _snapshot(tmp_path)
    with pytest.raises(Invalid, match=r"^hosts: agent certificates only dial out"):
        issue_cert(tmp_path, "agent", "node-9", ["10.1.2.3"])
    assert _snapshot(tmp_path) == before
    issue_cert(tmp_path, "scheduler", "s2", ["10.1.2.3"])
    assert {"scheduler.orka", "10.1.2.3"} <= set(
        _names(tmp_path / "scheduler-s2" / "scheduler-s2.crt")
    )


def test_init_certs_extra_hosts_only_in_server_certs(tmp_path: Path) -> None:
    init_certs(tmp_path, ["node-1"], ["api.example.com", "10.9.9.9"])
    for stem in ("controller", "scheduler"):
        names = _names(tmp_path / stem / f"{stem}.crt")
        assert {f"{stem}.orka", "api.example.com", "10.9.9.9", "localhost"} <= set(names)
    for path, uri in [
        (tmp_path / "admin.crt", "admin/admin"),
        (tmp_path / "agent-node-1" / "agent-node-1.crt", "agent/node-1"),
    ]:
        assert _names(path) == [f"spiffe://orka/{uri}"]


def test_init_certs_reserved_host_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(Invalid, match=r"^hosts: 'scheduler.orka' is reserved"):
        init_certs(tmp_path / "c", ["node-1"], ["scheduler.orka"])
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("role", "name", "field"),
    [("root", "x", "role"), ("agent", "UPPER", "name"), ("agent", "x" * 64, "name")],
)
def test_issue_cert_rejects_bad_input(tmp_path: Path, role: str, name: str, field: str) -> None:
    init_certs(tmp_path, [])
    with pytest.raises(Invalid, match=f"^{field}:"):
        issue_cert(tmp_path, role, name)


@pytest.mark.parametrize("missing", ["ca.crt", "ca/ca.key"])
def test_issue_cert_without_ca_names_the_file(tmp_path: Path, missing: str) -> None:
    init_certs(tmp_path, [])
    (tmp_path / missing).unlink()
    with pytest.raises(Invalid, match=re.escape(missing)):
        issue_cert(tmp_path, "agent", "node-1")
