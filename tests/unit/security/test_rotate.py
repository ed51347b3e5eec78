from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs

from orka.errors import NotFound
from orka.security import rotate as rotate_module
from orka.security import tls
from orka.security.ca import issue_leaf, key_pem
from orka.security.issue import init_certs, issue_cert, load_ca
from orka.security.rotate import rotate
from orka.security.tls import (
    ServerCertificates,
    TlsFiles,
    due_for_renewal,
    renewal_threshold,
    warn_if_expiring,
)
from tests.unit.security.handmade import handmade

NOW = dt.datetime.now(dt.UTC)


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    d = tmp_path / "certs"
    init_certs(d, ["node-1"], ["api.example.com"])
    return d


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


PAIRS = ["admin", "controller/controller", "scheduler/scheduler", "agent-node-1/agent-node-1"]


def test_rotate_all_reissues_every_pair_in_place(certs: Path) -> None:
    before = {p: (certs / f"{p}.crt").read_bytes() for p in PAIRS}
    keys = {p: (certs / f"{p}.key").read_bytes() for p in PAIRS}
    ca = ((certs / "ca.crt").read_bytes(), (certs / "ca" / "ca.key").read_bytes())
    written = rotate(certs)
    assert {str(p.relative_to(certs)) for p in written} == {
        f"{p}.{ext}" for p in PAIRS for ext in ("crt", "key")
    }
    for p in PAIRS:
        old, new = x509.load_pem_x509_certificate(before[p]), _cert(certs / f"{p}.crt")
        assert new.serial_number != old.serial_number
        assert (certs / f"{p}.key").read_bytes() != keys[p]  # a new key, not just a new cert
        uri = x509.UniformResourceIdentifier
        assert _sans(new).get_values_for_type(uri) == _sans(old).get_values_for_type(uri)
        if p.startswith(("controller", "scheduler")):
            assert _sans(new) == _sans(old)  # a server keeps the names it serves
        else:
            # Client certificates carry no host names (older ones had --host in every cert).
            assert _sans(new).get_values_for_type(x509.DNSName) == [] or p.startswith("agent")
        assert new.not_valid_after_utc - new.not_valid_before_utc == dt.timedelta(days=90)
        assert stat.S_IMODE((certs / f"{p}.key").stat().st_mode) == 0o600
    assert ((certs / "ca.crt").read_bytes(), (certs / "ca" / "ca.key").read_bytes()) == ca
    TlsFiles.for_service(certs, "agent", "node-1")


def test_rotate_one(certs: Path) -> None:
    admin = (certs / "admin.crt").read_bytes()
    written = rotate(certs, role="agent", name="node-1")
    assert written == [
        certs / "agent-node-1" / "agent-node-1.crt",
        certs / "agent-node-1" / "agent-node-1.key",
    ]
    assert (certs / "admin.crt").read_bytes() == admin
    with pytest.raises(NotFound, match="no agent certificate named 'node-2'"):
        rotate(certs, role="agent", name="node-2")


def _issue_expiring_in(certs: Path, name: str, left: dt.timedelta) -> None:
    end = NOW + left
    issue_cert(
        certs, "agent", name, not_valid_before=end - dt.timedelta(days=90), not_valid_after=end
    )


def test_rotate_only_due(certs: Path) -> None:
    _issue_expiring_in(certs, "old", dt.timedelta(days=29))
    _issue_expiring_in(certs, "fine", dt.timedelta(days=31))
    written = rotate(certs, only_due=True)
    assert {p.name for p in written} == {"agent-old.crt", "agent-old.key"}
    assert not due_for_renewal(_cert(certs / "agent-old" / "agent-old.crt"))
    assert rotate(certs, only_due=True) == []


@pytest.mark.parametrize(
    ("lifetime", "threshold"),
    [(90, 30), (365, 30), (9, 3), (1, 1 / 3)],
)
def test_renewal_threshold(certs: Path, lifetime: float, threshold: float) -> None:
    ca = load_ca(certs)
    leaf = issue_leaf(
        ca, "agent", "x", not_valid_before=NOW, not_valid_after=NOW + dt.timedelta(days=lifetime)
    )
    assert renewal_threshold(leaf.cert) == dt.timedelta(days=threshold)


def test_expiry_warning(certs: Path) -> None:
    _issue_expiring_in(certs, "soon", dt.timedelta(days=3))
    path = certs / "agent-soon" / "agent-soon.crt"
    with capture_logs() as logs:
        assert warn_if_expiring(path, _cert(path))
        assert not warn_if_expiring(certs / "admin.crt", _cert(certs / "admin.crt"))
    assert len(logs) == 1
    assert logs[0]["log_level"] == "warning"
    assert "orka certs rotate" in logs[0]["event"]
    assert logs[0]["path"] == str(path) and 2.9 < logs[0]["days_left"] <= 3.0


def _bump(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_server_certificates_follow_the_files(certs: Path) -> None:
    files = TlsFiles.for_service(certs, "controller", "controller")
    fetcher = ServerCertificates(files)
    first = fetcher.current.leaf.serial_number
    assert fetcher() is None  # nothing changed: gRPC keeps its configuration

    # Half a rotation: the new key is on disk, its certificate is not yet. Serving that pair
    # would fail every handshake, so the old one stays.
    leaf = issue_leaf(load_ca(certs), "controller", "controller")
    files.key.write_bytes(key_pem(leaf.key))
    with capture_logs() as logs:
        assert fetcher() is None
        assert fetcher() is None  # logged once, not per handshake
    assert [e["event"] for e in logs] == ["new certificate rejected; serving the previous one"]
    assert "does not match" in logs[0]["reason"]
    assert fetcher.current.leaf.serial_number == first

    rotate(certs, role="controller", name="controller")
    with capture_logs() as logs:
        assert fetcher() is not None
    assert [e["event"] for e in logs] == ["certificate reloaded"]
    assert fetcher.current.leaf.serial_number == _cert(files.cert).serial_number != first
    assert fetcher() is None


def test_server_certificates_refuse_another_identity(certs: Path) -> None:
    files = TlsFiles.for_service(certs, "controller", "controller")
    fetcher = ServerCertificates(files)
    for ext in ("crt", "key"):
        (certs / "controller" / f"controller.{ext}").write_bytes(
            (certs / f"admin.{ext}").read_bytes()
        )
    _bump(files.cert)
    with capture_logs() as logs:
        assert fetcher() is None
    assert "now names admin/admin" in logs[0]["reason"]


async def test_a_running_server_repeats_the_expiry_warning(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls, "EXPIRY_CHECK_INTERVAL", 0.05)
    end = NOW + dt.timedelta(days=2)
    issue_cert(
        certs,
        "controller",
        "controller",
        not_valid_before=end - dt.timedelta(days=90),
        not_valid_after=end,
    )
    with capture_logs() as logs:
        tls.server_credentials(TlsFiles.for_service(certs, "controller", "controller"))
        await asyncio.sleep(0.18)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) >= 2, logs
    assert all(e["path"].endswith("controller.crt") for e in warnings)


def test_rotate_leaves_the_reserved_role_names_to_issue_leaf() -> None:
    # A server certificate carries `controller.orka`, which issue_leaf adds itself and refuses
    # from callers: rotation hands over only the real host names and IPs.
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "controller/controller")])
    sans = [
        x509.UniformResourceIdentifier("spiffe://orka/controller/controller"),
        x509.DNSName("controller.orka"),
        x509.DNSName("api.example.com"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    cert = handmade(name, key.public_key(), key, sans=sans, serial=1, start=NOW, days=1)
    assert rotate_module._hosts(cert) == ["api.example.com", "127.0.0.1"]


def test_rotate_only_due_upgrades_a_server_certificate_without_its_role_name(certs: Path) -> None:
    # A data dir from before role names: its scheduler certificate would be refused by every
    # client, so `orka up`'s only-due rotation re-issues it, keeping the hosts it served.
    ca = load_ca(certs)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [
        x509.UniformResourceIdentifier("spiffe://orka/scheduler/scheduler"),
        x509.DNSName("api.example.com"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    start = NOW - dt.timedelta(minutes=5)
    old = handmade(
        "scheduler/scheduler",
        key.public_key(),
        ca.key,
        ca.cert.subject,
        sans=sans,
        start=start,
        days=(NOW + dt.timedelta(days=80) - start) / dt.timedelta(days=1),
    )
    folder = certs / "scheduler"
    (folder / "scheduler.key").write_bytes(key_pem(key))
    (folder / "scheduler.crt").write_bytes(old.public_bytes(serialization.Encoding.PEM))

    written = rotate(certs, only_due=True)
    assert {p.name for p in written} == {"scheduler.crt", "scheduler.key"}
    names = _sans(_cert(folder / "scheduler.crt")).get_values_for_type(x509.DNSName)
    assert "scheduler.orka" in names and "api.example.com" in names
    assert rotate(certs, only_due=True) == []
