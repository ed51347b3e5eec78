from __future__ import annotations

import datetime as dt
import ipaddress
import socket

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from orka.errors import Invalid
from orka.security.ca import (
    SERVING_ROLES,
    create_ca,
    issue_leaf,
    local_host_names,
    role_dns_name,
)


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


def _usage(**set_: bool) -> x509.KeyUsage:
    flags = dict.fromkeys(
        (
            "digital_signature",
            "content_commitment",
            "key_encipherment",
            "data_encipherment",
            "key_agreement",
            "key_cert_sign",
            "crl_sign",
        ),
        False,
    )
    return x509.KeyUsage(**{**flags, **set_}, encipher_only=False, decipher_only=False)


def test_the_ca_signs_leaves_only_and_a_leaf_signs_nothing() -> None:
    """A node's key must not be able to vouch for anyone: its certificate is no CA and may
    only sign handshakes; the CA's may sign certificates and CRLs, and none that sign more."""
    ca = create_ca()  # its own, not the module's: this test is about making one
    bc = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert (bc.ca, bc.path_length) == (True, 0)
    assert ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value == _usage(
        key_cert_sign=True, crl_sign=True
    )
    for role in ("agent", "controller"):
        leaf = issue_leaf(ca, role, "node-1").cert
        bc = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
        assert bc.critical and (bc.value.ca, bc.value.path_length) == (False, None)
        usage = leaf.extensions.get_extension_for_class(x509.KeyUsage)
        assert usage.critical and usage.value == _usage(digital_signature=True)


@pytest.mark.usefixtures("off_utc")
def test_a_fresh_certificate_is_valid_now_whatever_the_hosts_time_zone() -> None:
    now = dt.datetime.now(dt.UTC)
    for cert in (create_ca().cert, issue_leaf(create_ca(), "admin", "admin").cert):
        assert cert.not_valid_before_utc <= now <= cert.not_valid_after_utc
        assert now - cert.not_valid_before_utc < dt.timedelta(minutes=6)


def test_a_client_leaf_with_hosts_says_which_certificates_carry_them(ca) -> None:
    with pytest.raises(Invalid) as exc:
        issue_leaf(ca, "agent", "node-1", ["node.example.com"])
    assert exc.value.message == (
        "hosts: agent certificates only dial out, so they carry no host names; "
        "--host belongs to controller and scheduler certificates"
    )


def test_a_bad_host_is_quoted_up_to_80_characters(ca) -> None:
    for size, shown in ((80, "é" * 80), (81, "é" * 80 + "...")):
        with pytest.raises(Invalid) as exc:
            issue_leaf(ca, "controller", "controller", ["é" * size])
        assert exc.value.message == f"hosts: {shown!r} is not an ASCII DNS name or IP address"


def test_a_serving_certificate_names_this_host_as_the_system_knows_it(
    ca, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = [
        (("node-a", "node-a.example.com"), ["localhost", "node-a", "node-a.example.com"]),
        (("node-a", "node-a"), ["localhost", "node-a"]),
        (("", "localhost"), ["localhost"]),
    ]
    for (host, fqdn), names in cases:
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        monkeypatch.setattr(socket, "getfqdn", lambda fqdn=fqdn: fqdn)
        assert local_host_names() == names
        dns = _sans(issue_leaf(ca, "scheduler", "s1").cert).get_values_for_type(x509.DNSName)
        assert dns == ["scheduler.orka", *names]
