"""The CRL a service watches: what a file must be to be taken, what the watcher says about it,
and the one watcher per file and event loop that `watch` keeps."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs

from orka.errors import Invalid
from orka.security.issue import init_certs, load_ca
from orka.security.revocation import (
    _WATCHERS,
    MAX_CRL_BYTES,
    REVOCATIONS,
    CrlWatcher,
    Revocations,
    crl_number,
    parse_crl,
    watch,
)
from orka.security.revoke import revoke, serial_of
from tests.unit.security.handmade import handmade
from tests.waits import until

NOW = dt.datetime.now(dt.UTC)


def _watcher(certs: Path, registry: Revocations | None = None, interval: float = 1.0) -> CrlWatcher:
    own = certs / "controller"
    return CrlWatcher(own / "crl.pem", own / "ca.crt", interval, registry or Revocations())


def _touch(path: Path) -> None:
    """A new mtime for the same content, past the filesystem's timestamp granularity."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _crl(
    key: ec.EllipticCurvePrivateKey, issuer: x509.Name, serials: list[int], number: int | None
) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer)
        .last_update(NOW)
        .next_update(NOW + dt.timedelta(days=1))
    )
    if number is not None:
        builder = builder.add_extension(x509.CRLNumber(number), critical=False)
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(NOW).build()
        )
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _errors(logs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in logs if e["log_level"] == "error"]


# -- parse_crl, crl_number --------------------------------------------------------------------


def test_a_crl_at_the_size_limit_is_parsed_not_refused_for_its_size(certs: Path) -> None:
    ca = load_ca(certs).cert
    with pytest.raises(Invalid, match="is not a PEM certificate revocation list"):
        parse_crl(b"x" * MAX_CRL_BYTES, ca, "f.pem")
    with pytest.raises(Invalid) as info:
        parse_crl(b"x" * (MAX_CRL_BYTES + 1), ca, "f.pem")
    assert info.value.message == (
        f"crl: f.pem is {MAX_CRL_BYTES + 1} bytes, over the {MAX_CRL_BYTES} limit"
    )


def test_a_crl_of_another_issuer_is_refused_naming_both(certs: Path) -> None:
    ca = load_ca(certs)
    other = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "someone else")])
    data = _crl(ca.key, other, [5], 1)  # type: ignore[arg-type]
    with pytest.raises(Invalid) as info:
        parse_crl(data, ca.cert, "f.pem")
    assert info.value.message == (
        "crl: f.pem was issued by 'CN=someone else', not the cluster CA 'CN=orka cluster CA'"
    )


def test_a_ca_whose_key_cannot_verify_a_signature_accepts_no_crl(certs: Path) -> None:
    """A CA certificate carrying a key-agreement key (X25519): verifying raises rather than
    answering false, and that is a refusal too."""
    signer = ec.generate_private_key(ec.SECP256R1())
    name = load_ca(certs).cert.subject
    odd_ca = handmade(name, x25519.X25519PrivateKey.generate().public_key(), signer)
    with pytest.raises(Invalid) as info:
        parse_crl(_crl(signer, name, [5], 1), odd_ca, "f.pem")
    assert info.value.message == "crl: f.pem is not signed by the cluster CA"


def test_a_crl_without_a_number_counts_as_number_zero(certs: Path) -> None:
    ca = load_ca(certs)
    unnumbered = x509.load_pem_x509_crl(_crl(ca.key, ca.cert.subject, [5], None))  # type: ignore[arg-type]
    numbered = x509.load_pem_x509_crl(_crl(ca.key, ca.cert.subject, [5], 7))  # type: ignore[arg-type]
    assert (crl_number(unnumbered), crl_number(numbered)) == (0, 7)


# -- CrlWatcher.load ------------------------------------------------------------------------


@pytest.fixture
def loaded(certs: Path) -> tuple[CrlWatcher, int]:
    """A watcher that took a CRL revoking the admin, and the admin's serial."""
    admin = serial_of(certs, "admin", "admin")
    revoke(certs, [admin])
    watcher = _watcher(certs)
    watcher.load()
    return watcher, admin


def test_a_first_crl_without_a_number_is_taken(certs: Path) -> None:
    ca = load_ca(certs)
    watcher = _watcher(certs)
    watcher.crl.write_bytes(_crl(ca.key, ca.cert.subject, [41, 42], None))  # type: ignore[arg-type]
    with capture_logs() as logs:
        watcher.load()
    assert _errors(logs) == []
    assert watcher.registry.revoked == {41, 42}


def test_loading_says_which_file_and_how_many_serials(certs: Path) -> None:
    admin = serial_of(certs, "admin", "admin")
    node = serial_of(certs, "agent", "node-1")
    revoke(certs, [admin, node])
    watcher = _watcher(certs)
    with capture_logs() as logs:
        watcher.load()
    assert logs == [
        {
            "event": "crl loaded",
            "log_level": "info",
            "path": str(watcher.crl),
            "revoked": 2,
            "calls_cut": 0,
        }
    ]


def test_the_same_crl_touched_is_taken_again_not_refused_as_older(
    loaded: tuple[CrlWatcher, int],
) -> None:
    watcher, admin = loaded
    _touch(watcher.crl)
    with capture_logs() as logs:
        watcher.load()
    assert [e["event"] for e in logs] == ["crl loaded"]
    assert watcher.registry.is_revoked(admin)


def test_an_oversized_file_is_read_only_up_to_the_limit(certs: Path) -> None:
    watcher = _watcher(certs)
    watcher.crl.write_bytes(b"x" * (MAX_CRL_BYTES + 4096))
    with capture_logs() as logs:
        watcher.load()
    assert [(e["event"], e["path"], e["reason"]) for e in logs] == [
        (
            "crl rejected; keeping the previous one",
            str(watcher.crl),
            f"crl: {watcher.crl} is {MAX_CRL_BYTES + 1} bytes, over the {MAX_CRL_BYTES} limit",
        )
    ]


def _unreadable(watcher: CrlWatcher, error: str) -> list[dict[str, object]]:
    return [
        {
            "event": "crl unreadable; keeping the previous one",
            "log_level": "error",
            "path": str(watcher.crl),
            "error": f"{error}: '{watcher.crl}'",
        }
    ]


def test_a_crl_that_cannot_be_stat_ed_keeps_the_previous_one(
    loaded: tuple[CrlWatcher, int],
) -> None:
    watcher, admin = loaded
    watcher.crl.unlink()
    watcher.crl.symlink_to(watcher.crl.name)  # a link to itself: stat fails with ELOOP
    with capture_logs() as logs:
        watcher.load()
    assert watcher.registry.is_revoked(admin)
    assert logs == _unreadable(watcher, "[Errno 40] Too many levels of symbolic links")


def test_a_crl_that_cannot_be_read_keeps_the_previous_one_until_a_good_one(
    certs: Path, loaded: tuple[CrlWatcher, int]
) -> None:
    watcher, admin = loaded
    watcher.crl.unlink()
    watcher.crl.mkdir()  # stat works, reading does not
    with capture_logs() as logs:
        watcher.load()
    assert watcher.registry.is_revoked(admin)
    assert logs == _unreadable(watcher, "[Errno 21] Is a directory")
    watcher.crl.rmdir()
    node = serial_of(certs, "agent", "node-1")
    revoke(certs, [node])
    with capture_logs() as logs:
        watcher.load()
    assert [e["event"] for e in logs] == ["crl loaded"]
    assert watcher.registry.is_revoked(node) and watcher.registry.is_revoked(admin)


def test_an_unreadable_ca_keeps_the_previous_crl(loaded: tuple[CrlWatcher, int]) -> None:
    watcher, admin = loaded
    watcher.ca.write_bytes(b"not a certificate")
    _touch(watcher.crl)
    with capture_logs() as logs:
        watcher.load()
    assert watcher.registry.is_revoked(admin)
    assert [(e["event"], e["path"]) for e in logs] == [
        ("crl unreadable; keeping the previous one", str(watcher.crl))
    ]
    assert "Unable to load PEM file" in str(logs[0]["error"])


def _clusters(tmp_path: Path) -> list[tuple[Path, int]]:
    """Two clusters, each with a CRL revoking its own admin: (folder, admin's serial)."""
    out = []
    for cluster in ("a", "b"):
        d = tmp_path / cluster
        init_certs(d, [])
        admin = serial_of(d, "admin", "admin")
        revoke(d, [admin])
        out.append((d, admin))
    return out


def test_watchers_of_two_files_in_one_registry_add_up(tmp_path: Path) -> None:
    """Each file's serials are kept apart: a process serving two clusters' CAs refuses both
    lists, and forgetting one file keeps the other's."""
    registry = Revocations()
    (a, admin_a), (b, admin_b) = _clusters(tmp_path)
    watchers = [_watcher(a, registry), _watcher(b, registry)]
    for watcher in watchers:
        watcher.load()
    assert registry.revoked == {admin_a, admin_b}
    registry.forget(watchers[0].crl)
    assert registry.revoked == {admin_b}


# -- started, stopped -----------------------------------------------------------------------


async def test_a_started_watcher_reloads_until_stopped(certs: Path) -> None:
    watcher = _watcher(certs, interval=0.02)
    watcher.stop()  # never started: nothing to cancel
    watcher.start(asyncio.get_running_loop())
    admin = serial_of(certs, "admin", "admin")
    revoke(certs, [admin])
    await until(lambda: watcher.registry.is_revoked(admin), timeout=5.0)
    watcher.stop()
    watcher.stop()
    node = serial_of(certs, "agent", "node-1")
    revoke(certs, [node])
    # Nothing to wait for when nothing happens: ten intervals are ample for a tick to land.
    await asyncio.sleep(0.2)
    assert not watcher.registry.is_revoked(node)


# -- watch ----------------------------------------------------------------------------------


@pytest.fixture
def own_watchers() -> Iterator[None]:
    """`watch` keeps process-wide state; what a test adds is stopped and forgotten after it."""
    before = set(_WATCHERS)
    yield
    for key in set(_WATCHERS) - before:
        stale = _WATCHERS.pop(key)
        stale.stop()
        REVOCATIONS.forget(stale.crl)


@pytest.mark.usefixtures("own_watchers")
async def test_watch_keeps_one_watcher_per_file_at_the_shortest_interval(certs: Path) -> None:
    admin = serial_of(certs, "admin", "admin")
    revoke(certs, [admin])
    crl = certs / "controller" / "crl.pem"
    first = watch(crl, certs / "controller" / "ca.crt", 5.0)
    assert REVOCATIONS.is_revoked(admin)
    # The same file by another spelling is the same watcher, now at the shorter interval.
    again = watch(certs / "scheduler" / ".." / "controller" / "crl.pem", crl.parent / "ca.crt", 2.0)
    assert again is first and first.interval == 2.0
    assert watch(crl, crl.parent / "ca.crt", 3.0).interval == 2.0
    other = watch(certs / "scheduler" / "crl.pem", certs / "scheduler" / "ca.crt", 5.0)
    assert other is not first and other.crl == (certs / "scheduler" / "crl.pem").resolve()


def test_a_watcher_of_a_closed_loop_is_dropped_with_its_serials(
    tmp_path: Path, own_watchers: None
) -> None:
    (a, admin_a), (b, admin_b) = _clusters(tmp_path)

    async def watch_a() -> CrlWatcher:
        return watch(a / "controller" / "crl.pem", a / "controller" / "ca.crt", 5.0)

    stale = asyncio.run(watch_a())
    assert REVOCATIONS.is_revoked(admin_a)

    async def watch_b() -> CrlWatcher:
        return watch(b / "controller" / "crl.pem", b / "controller" / "ca.crt", 5.0)

    fresh = asyncio.run(watch_b())
    assert not REVOCATIONS.is_revoked(admin_a) and REVOCATIONS.is_revoked(admin_b)
    assert stale not in _WATCHERS.values() and fresh in _WATCHERS.values()
