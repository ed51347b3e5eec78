from __future__ import annotations

import datetime as dt
import ipaddress
import socket

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from orka.errors import Invalid
from orka.security.ca import SERVING_ROLES, create_ca, issue_leaf, role_dns_name


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


@pytest.mark.parametrize(("role", "name"), [("controller", "controller"), ("scheduler", "c2")])
def test_serving_leaf_sans_usage_and_signature(ca, role: str, name: str) -> None:
    leaf = issue_leaf(ca, role, name, ["api.example.com", "10.0.0.5"])
    cert = leaf.cert
    cert.verify_directly_issued_by(ca.cert)
    sans = _sans(cert)
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"spiffe://orka/{role}/{name}"
    ]
    dns = sans.get_values_for_type(x509.DNSName)
    ips = sans.get_values_for_type(x509.IPAddress)
    # The reserved role name is what Orka's clients verify; the host names are for grpcurl.
    assert dns[0] == f"{role}.orka"
    assert [d for d in dns if d.endswith(".orka")] == [f"{role}.orka"]
    assert {"api.example.com", "localhost", socket.gethostname().lower()} <= set(dns)
    assert {
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    } <= set(ips)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.subject.rfc4514_string() == f"CN={role}/{name}"
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert life == dt.timedelta(days=365)


@pytest.mark.parametrize(
    ("role", "name"), [("agent", "node-1"), ("admin", "admin"), ("viewer", "alice")]
)
def test_client_leaf_has_client_auth_only_and_no_host_names(ca, role: str, name: str) -> None:
    cert = issue_leaf(ca, role, name).cert
    cert.verify_directly_issued_by(ca.cert)
    sans = _sans(cert)
    # Only the identity: no DNS name or IP an Orka client (or grpcurl) could verify it by.
    assert [g.value for g in sans] == [f"spiffe://orka/{role}/{name}"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


@pytest.mark.parametrize("role", ["agent", "admin", "viewer"])
def test_client_leaf_refuses_hosts(ca, role: str) -> None:
    with pytest.raises(Invalid, match=rf"^hosts: {role} certificates only dial out"):
        issue_leaf(ca, role, "x", ["node.example.com"])
    # Blank entries (an empty ORKA_HOST) are not hosts.
    issue_leaf(ca, role, "x", ["", " "])


@pytest.mark.parametrize(
    "host", ["scheduler.orka", "controller.orka", "Controller.ORKA", "orka", "x.y.orka", "a.orka."]
)
def test_reserved_role_names_are_refused_as_hosts(ca, host: str) -> None:
    with pytest.raises(Invalid, match=r"^hosts: .* is reserved"):
        issue_leaf(ca, "controller", "controller", ["ok.example.com", host])


def test_role_dns_name_only_for_serving_roles() -> None:
    assert role_dns_name("scheduler") == "scheduler.orka"
    assert role_dns_name("controller") == "controller.orka"
    assert SERVING_ROLES == {"controller", "scheduler"}
    for role in ("agent", "admin", "viewer", "root"):
        with pytest.raises(Invalid, match=r"^role: .* does not serve"):
            role_dns_name(role)


def test_host_errors_are_bounded(ca) -> None:
    with pytest.raises(Invalid) as exc:
        issue_leaf(ca, "controller", "controller", ["é" * 100_000])
    assert len(exc.value.message) < 200


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
