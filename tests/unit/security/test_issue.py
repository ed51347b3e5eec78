from __future__ import annotations

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
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_init_certs_layout_and_modes(tmp_path: Path) -> None:
    written = init_certs(tmp_path, ["node-1", "node-2"], ["api.example.com"])
    names = {p.name for p in written}
    stems = ["ca", "controller", "scheduler", "admin", "agent-node-1", "agent-node-2"]
    assert names == {f"{s}.{ext}" for s in stems for ext in ("crt", "key")}
    assert set(_snapshot(tmp_path)) == names  # no temp files left behind
    for s in stems:
        assert stat.S_IMODE((tmp_path / f"{s}.key").stat().st_mode) == 0o600
    for role, name in [("admin", "admin"), ("agent", "node-2"), ("controller", "controller")]:
        ident = load_and_check(TlsFiles.for_service(tmp_path, role, name))
        assert (ident.role, ident.name) == (role, name)


def test_init_certs_idempotent_and_resumes(tmp_path: Path) -> None:
    init_certs(tmp_path, ["node-1"])
    before = _snapshot(tmp_path)
    assert init_certs(tmp_path, ["node-1"]) == []
    assert _snapshot(tmp_path) == before

    # A run interrupted before the scheduler pair and a new node: only those are added,
    # signed by the existing CA.
    (tmp_path / "scheduler.crt").unlink()
    written = init_certs(tmp_path, ["node-1", "node-2"])
    assert {p.name for p in written} == {
        "scheduler.crt",
        "scheduler.key",
        "agent-node-2.crt",
        "agent-node-2.key",
    }
    after = _snapshot(tmp_path)
    for name in ("ca.crt", "ca.key", "admin.crt", "agent-node-1.key"):
        assert after[name] == before[name]
    load_and_check(TlsFiles.for_service(tmp_path, "scheduler", "scheduler"))


def test_init_certs_bad_node_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(Invalid, match=r"^name:"):
        init_certs(tmp_path / "c", ["ok", "Not_OK"])
    assert not (tmp_path / "c").exists()


def test_issue_cert(tmp_path: Path) -> None:
    init_certs(tmp_path, [])
    paths = issue_cert(tmp_path, "agent", "node-9")
    assert [p.name for p in paths] == ["agent-node-9.crt", "agent-node-9.key"]
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
    assert {"scheduler.orka", "10.1.2.3"} <= set(_names(tmp_path / "scheduler-s2.crt"))


def test_init_certs_extra_hosts_only_in_server_certs(tmp_path: Path) -> None:
    init_certs(tmp_path, ["node-1"], ["api.example.com", "10.9.9.9"])
    for stem in ("controller", "scheduler"):
        names = _names(tmp_path / f"{stem}.crt")
        assert {f"{stem}.orka", "api.example.com", "10.9.9.9", "localhost"} <= set(names)
    for stem, uri in [("admin", "admin/admin"), ("agent-node-1", "agent/node-1")]:
        assert _names(tmp_path / f"{stem}.crt") == [f"spiffe://orka/{uri}"]


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


@pytest.mark.parametrize("missing", ["ca.crt", "ca.key"])
def test_issue_cert_without_ca_names_the_file(tmp_path: Path, missing: str) -> None:
    init_certs(tmp_path, [])
    (tmp_path / missing).unlink()
    with pytest.raises(Invalid, match=re.escape(missing)):
        issue_cert(tmp_path, "agent", "node-1")
