"""`orka certs revoke` and `orka certs rotate` at their edges: serials as people paste them, the
CRL's number extension, a bad file named, and a rotation that keeps a server's names, leaves
foreign pairs alone, judges due-ness at the time given and brings the folder up to date."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from orka.errors import Invalid
from orka.security.ca import key_pem
from orka.security.issue import load_ca
from orka.security.revoke import current_crl, parse_serial, revoke, serial_of
from orka.security.rotate import rotate
from tests.unit.security.handmade import handmade

LONGEST = "f" * 40  # a certificate serial is at most 20 bytes


def test_a_serial_of_forty_digits_is_taken_with_its_0x() -> None:
    assert parse_serial("0x" + LONGEST) == int(LONGEST, 16)
    assert parse_serial("0X" + LONGEST.upper()) == int(LONGEST, 16)
    with pytest.raises(Invalid) as info:
        parse_serial("0x1" + LONGEST)
    assert info.value.message == (
        "serial: must be 1 to 40 hex digits (a certificate serial is 20 bytes)"
    )


def test_a_serial_that_is_not_hex_is_quoted_to_64_characters() -> None:
    text = ":" * 70 + "zz"  # the colons go before the length check; the quote keeps them
    with pytest.raises(Invalid) as info:
        parse_serial(text)
    assert info.value.message == f"serial: {':' * 64!r} is not a hexadecimal number"


def test_the_crl_number_is_a_non_critical_extension(certs: Path) -> None:
    """RFC 5280 5.2.3: the CRL number is marked non-critical; a reader that does not know it
    must still be able to use the list."""
    revoke(certs, [serial_of(certs, "admin", "admin")])
    crl = current_crl(certs)
    assert crl is not None
    number = crl.extensions.get_extension_for_class(x509.CRLNumber)
    assert (number.critical, number.value.crl_number) == (False, 1)


@pytest.mark.usefixtures("off_utc")
def test_a_crl_is_dated_now_whatever_the_hosts_time_zone(certs: Path) -> None:
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    revoke(certs, [serial_of(certs, "admin", "admin")])
    crl = current_crl(certs)
    assert crl is not None
    assert before <= crl.last_update_utc <= dt.datetime.now(dt.UTC)


def test_a_bad_crl_or_certificate_is_named(certs: Path) -> None:
    (certs / "crl.pem").write_bytes(b"junk")
    with pytest.raises(Invalid) as info:
        revoke(certs, [1])
    assert info.value.message.startswith(
        f"crl: {certs / 'crl.pem'} is not a PEM certificate revocation list: "
    )
    (certs / "admin.crt").write_bytes(b"junk")
    with pytest.raises(Invalid) as info:
        serial_of(certs, "admin", "admin")
    assert info.value.message.startswith(f"certs: {certs / 'admin.crt'} is not a PEM certificate: ")
    with pytest.raises(Invalid) as info:
        rotate(certs)
    assert info.value.message.startswith(f"certs: {certs / 'admin.crt'} is not a PEM certificate: ")


def _dns(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName)


def test_a_rotated_server_keeps_its_names_but_not_reserved_ones_written_with_a_dot(
    certs: Path,
) -> None:
    """A certificate made by hand may spell the reserved names with a trailing dot; they are
    Orka's to add, so they are not carried over as hosts (which would be refused)."""
    ca = load_ca(certs)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier("spiffe://orka/controller/controller"),
        x509.DNSName("controller.orka."),
        x509.DNSName("orka."),
        x509.DNSName("api.example.com"),
    ]
    cert = handmade("controller", key.public_key(), ca.key, ca.cert.subject, sans=sans, days=31)
    folder = certs / "controller"
    (folder / "controller.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "controller.key").write_bytes(key_pem(key))
    rotate(certs, role="controller", name="controller")
    dns = _dns(folder / "controller.crt")
    assert dns[0] == "controller.orka" and "api.example.com" in dns
    assert [d for d in dns if d.rstrip(".").endswith("orka")] == ["controller.orka"]


def test_rotating_all_leaves_a_foreign_pair_alone(certs: Path) -> None:
    """An operator's own pair kept in the same directory (a web server's, say) is not ours."""
    key = ec.generate_private_key(ec.SECP256R1())
    site = handmade("site", key.public_key(), key, serial=1)
    pem = site.public_bytes(serialization.Encoding.PEM)
    (certs / "site.crt").write_bytes(pem)
    (certs / "site.key").write_bytes(key_pem(key))
    (certs / "controller" / "nginx.crt").write_bytes(pem)  # no key beside it
    written = rotate(certs)
    assert certs / "controller" / "controller.crt" in written
    assert not {p.name for p in written} & {"site.crt", "site.key", "nginx.crt"}
    assert (certs / "site.crt").read_bytes() == pem


def test_only_due_is_judged_at_the_time_given(certs: Path) -> None:
    assert rotate(certs, only_due=True) == []
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=80)  # of 90 days: all due
    written = rotate(certs, only_due=True, now=later)
    assert {p.name for p in written if p.suffix == ".crt"} == {
        "admin.crt",
        "controller.crt",
        "scheduler.crt",
        "agent-node-1.crt",
    }


def test_a_role_without_a_name_is_refused(certs: Path) -> None:
    with pytest.raises(Invalid) as info:
        rotate(certs, role="agent")
    assert info.value.message == "name: is required with role"


def test_a_rotated_service_folder_is_closed_and_given_the_current_crl(certs: Path) -> None:
    revoke(certs, [serial_of(certs, "admin", "admin")])
    folder = certs / "agent-node-1"
    (folder / "crl.pem").unlink()
    folder.chmod(0o755)
    rotate(certs, role="agent", name="node-1")
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "crl.pem").read_bytes() == (certs / "crl.pem").read_bytes()
