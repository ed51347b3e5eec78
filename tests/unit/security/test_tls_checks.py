"""A service's certificate files: the errors naming what is wrong with them, the checks at the
time given and at the ends of a validity, and what a running service says about them (the
expiry warning and its figures, a reload, a rejection that is not an Orka error)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from structlog.testing import capture_logs

from orka.errors import Invalid
from orka.security import tls
from orka.security.issue import issue_cert, load_ca
from orka.security.tls import (
    ServerCertificates,
    TlsFiles,
    due_for_renewal,
    load_and_check,
    warn_if_expiring,
)
from tests.unit.security.handmade import handmade
from tests.waits import until

# Whole seconds (what a certificate holds), an hour ahead: inside the test CA's validity.
NOW = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).replace(microsecond=0)
DAYS_90 = dt.timedelta(days=90)


def _controller(certs: Path) -> TlsFiles:
    return TlsFiles.for_service(certs, "controller", "controller")


def _reissue(certs: Path, start: dt.datetime, end: dt.datetime) -> x509.Certificate:
    issue_cert(certs, "controller", "controller", not_valid_before=start, not_valid_after=end)
    return x509.load_pem_x509_certificate(_controller(certs).cert.read_bytes())


def test_renewal_is_due_from_the_threshold_itself(certs: Path) -> None:
    cert = _reissue(certs, NOW, NOW + DAYS_90)  # a third of 90 days: due 30 days before
    due_at = NOW + DAYS_90 - dt.timedelta(days=30)
    assert not due_for_renewal(cert, due_at - dt.timedelta(seconds=1))
    assert due_for_renewal(cert, due_at)


def test_the_expiry_warning_is_judged_at_the_time_given_and_says_when(certs: Path) -> None:
    cert = _reissue(certs, NOW, NOW + DAYS_90)
    path = _controller(certs).cert
    then = NOW + DAYS_90 - dt.timedelta(days=3, hours=2)
    with capture_logs() as logs:
        assert not warn_if_expiring(path, cert, NOW)
        assert warn_if_expiring(path, cert, then)
    assert logs == [
        {
            "event": "certificate expires soon; re-issue it with `orka certs rotate`",
            "log_level": "warning",
            "path": str(path),
            "expires": (NOW + DAYS_90).isoformat(),
            "days_left": 3.1,  # 3 days 2 hours, to a tenth of a day
        }
    ]


def test_files_are_checked_at_the_time_given(certs: Path) -> None:
    _reissue(certs, NOW, NOW + DAYS_90)
    files = _controller(certs)
    assert load_and_check(files, NOW + dt.timedelta(days=1)).uri == (
        "spiffe://orka/controller/controller"
    )
    later = NOW + DAYS_90 + dt.timedelta(days=1)
    with pytest.raises(Invalid) as info:
        load_and_check(files, later)
    assert info.value.message == f"certs: {files.cert} expired at {(NOW + DAYS_90).isoformat()}"


def test_a_server_without_an_event_loop_says_its_crl_is_not_watched(certs: Path) -> None:
    files = _controller(certs)
    with capture_logs() as logs:
        tls.server_credentials(files)
    assert logs == [
        {
            "event": "no event loop: the CRL is not watched",
            "log_level": "warning",
            "crl": str(files.crl),
        }
    ]


async def test_a_running_server_warns_again_at_every_interval(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls, "EXPIRY_CHECK_INTERVAL", 0.02)
    now = dt.datetime.now(dt.UTC)
    _reissue(certs, now - DAYS_90 + dt.timedelta(days=2), now + dt.timedelta(days=2))
    with capture_logs() as logs:
        tls.server_credentials(_controller(certs))

        def warnings() -> int:
            return sum(e["log_level"] == "warning" for e in logs)

        await until(lambda: warnings() >= 4, timeout=5.0)


def test_a_reload_says_what_it_loaded_and_warns_of_its_expiry(certs: Path) -> None:
    files = _controller(certs)
    fetcher = ServerCertificates(files)
    now = dt.datetime.now(dt.UTC)
    end = now + dt.timedelta(days=2)
    cert = _reissue(certs, end - DAYS_90, end)
    with capture_logs() as logs:
        assert fetcher() is not None
    expires = cert.not_valid_after_utc.isoformat()
    assert [(e["event"], e["path"], e["expires"]) for e in logs] == [
        ("certificate reloaded", str(files.cert), expires),
        (
            "certificate expires soon; re-issue it with `orka certs rotate`",
            str(files.cert),
            expires,
        ),
    ]
    assert logs[0]["serial"] == format(cert.serial_number, "x")


def test_an_unexpected_error_in_a_reload_is_logged_once_and_never_raised(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _controller(certs)
    fetcher = ServerCertificates(files)
    first = fetcher.current.leaf.serial_number

    def broken(cls: type[tls.Pems], files: TlsFiles, now: object = None) -> tls.Pems:
        raise RuntimeError("a bug, not a bad file")

    monkeypatch.setattr(tls.Pems, "read", classmethod(broken))
    _reissue(certs, NOW - dt.timedelta(days=1), NOW + DAYS_90)
    with capture_logs() as logs:
        assert fetcher() is None
        assert fetcher() is None  # once per change on disk, not per handshake
    assert [(e["event"], e["log_level"], e.get("exc_info")) for e in logs] == [
        ("new certificate rejected; serving the previous one", "error", True)
    ]
    assert fetcher.current.leaf.serial_number == first


def test_a_certificate_is_valid_at_both_ends_of_its_validity(certs: Path) -> None:
    _reissue(certs, NOW, NOW + DAYS_90)
    files = _controller(certs)
    for at in (NOW, NOW + DAYS_90):
        assert load_and_check(files, at).name == "controller"
    with pytest.raises(Invalid) as info:
        load_and_check(files, NOW - dt.timedelta(seconds=1))
    assert info.value.message == f"certs: {files.cert} is not valid until {NOW.isoformat()}"


def test_an_expired_ca_is_named(certs: Path) -> None:
    files = _controller(certs)
    ca = load_ca(certs).cert
    later = ca.not_valid_after_utc + dt.timedelta(days=1)
    with pytest.raises(Invalid) as info:
        load_and_check(files, later)
    assert info.value.message == (
        f"certs: {files.ca} expired at {ca.not_valid_after_utc.isoformat()}"
    )


def test_each_bad_file_is_named_with_what_is_wrong(certs: Path) -> None:
    files = _controller(certs)
    files.ca.write_bytes(b"junk")
    with pytest.raises(Invalid) as info:
        load_and_check(files)
    assert info.value.message.startswith(f"certs: {files.ca} is not a PEM certificate: ")
    (certs / "controller" / "ca.crt").write_bytes((certs / "ca.crt").read_bytes())
    files.key.write_bytes(b"junk")
    with pytest.raises(Invalid) as info:
        load_and_check(files)
    assert info.value.message.startswith(
        f"certs: {files.key} is not an unencrypted PEM private key: "
    )
    files.key.unlink()
    with pytest.raises(Invalid) as info:
        load_and_check(files)
    assert info.value.message == f"certs: cannot read {files.key}: No such file or directory"


def test_a_certificate_without_an_orka_identity_is_named(certs: Path) -> None:
    """Signed by the cluster CA, right key, but no spiffe://orka/ name: not a peer of ours."""
    ca = load_ca(certs)
    files = _controller(certs)
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    bare = handmade(
        "controller",
        key.public_key(),
        ca.key,
        ca.cert.subject,
        start=NOW - dt.timedelta(days=1),
        days=91,
    )
    files.cert.write_bytes(bare.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(Invalid) as info:
        load_and_check(files)
    assert info.value.message == (
        f"certs: {files.cert}: certificate has no subjectAltName extension"
    )


def test_for_service_names_the_missing_file(certs: Path) -> None:
    own = certs / "agent-node-1"
    (own / "agent-node-1.key").unlink()
    with pytest.raises(Invalid) as info:
        TlsFiles.for_service(certs, "agent", "node-1")
    assert info.value.message == (
        f"certs: found {own / 'agent-node-1.crt'} but its key {own / 'agent-node-1.key'} "
        "does not exist"
    )
    empty = certs.parent / "empty"
    empty.mkdir()
    with pytest.raises(Invalid) as info:
        TlsFiles.for_service(empty, "agent", "node-1")
    assert info.value.message == f"certs: {empty / 'ca.crt'} does not exist"
    with pytest.raises(Invalid) as info:
        TlsFiles.for_service(certs, "agent", "node-2")
    tried = [
        certs / "agent-node-2" / "agent-node-2.crt",
        certs / "agent-node-2.crt",
        certs / "agent" / "agent.crt",
        certs / "agent.crt",
    ]
    assert info.value.message == (
        f"certs: no certificate for agent 'node-2'; tried {', '.join(map(str, tried))}"
    )
