from __future__ import annotations

import datetime as dt
import ipaddress
import socket

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from orka.errors import Invalid
from orka.security.ca import create_ca, issue_leaf


@pytest.fixture(scope="module")
def ca():
    return create_ca()


def test_ca_is_a_self_signed_p256_ca(ca) -> None:
    cert = ca.cert
    assert isinstance(ca.key.curve, ec.SECP256R1)
    assert cert.subject.rfc4514_string() == "CN=orka cluster CA"
    assert cert.issuer == cert.subject
    cert.verify_directly_issued_by(cert)
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life >= dt.timedelta(days=3650)


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


@pytest.mark.parametrize(
    ("role", "name", "serves"),
    [
        ("controller", "controller", True),
        ("scheduler", "scheduler", True),
        ("agent", "node-1", True),
        ("admin", "admin", False),
    ],
)
def test_leaf_sans_and_signature(ca, role: str, name: str, serves: bool) -> None:
    leaf = issue_leaf(ca, role, name, ["api.example.com", "10.0.0.5"])
    cert = leaf.cert
    cert.verify_directly_issued_by(ca.cert)
    sans = _sans(cert)
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"spiffe://orka/{role}/{name}"
    ]
    dns = sans.get_values_for_type(x509.DNSName)
    ips = sans.get_values_for_type(x509.IPAddress)
    assert "api.example.com" in dns
    assert ipaddress.ip_address("10.0.0.5") in ips
    host_names = {"localhost", socket.gethostname().lower()}
    local_ips = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    assert host_names <= set(dns) if serves else not (host_names & set(dns))
    assert local_ips <= set(ips) if serves else not (local_ips & set(ips))
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.subject.rfc4514_string() == f"CN={role}/{name}"
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life == dt.timedelta(days=365)


def test_leaf_custom_validity(ca) -> None:
    start = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    end = dt.datetime(2020, 1, 2, tzinfo=dt.UTC)
    leaf = issue_leaf(ca, "admin", "admin", not_valid_before=start, not_valid_after=end)
    assert leaf.cert.not_valid_before_utc == start
    assert leaf.cert.not_valid_after_utc == end


@pytest.mark.parametrize(
    ("role", "name", "field"),
    [
        ("root", "x", "role"),
        ("", "x", "role"),
        ("agent", "Node1", "name"),
        ("agent", "-node", "name"),
        ("agent", "node-", "name"),
        ("agent", "a" * 64, "name"),
        ("agent", "", "name"),
        ("agent", "a/b", "name"),
    ],
)
def test_bad_role_or_name_is_invalid(ca, role: str, name: str, field: str) -> None:
    with pytest.raises(Invalid) as exc:
        issue_leaf(ca, role, name)
    assert exc.value.message.startswith(f"{field}:")
