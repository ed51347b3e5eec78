"""`orka certs` and the services' start-up checks, as the role rules make them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cryptography import x509

from orka.cli.main import main
from orka.cli.services import check_tls
from orka.errors import Invalid
from tests.integration.identities import write_legacy_cert


def _dns(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName)


@pytest.mark.parametrize("role", ["agent", "admin", "viewer"])
def test_issue_refuses_host_for_a_client_role(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str
) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    before = sorted(p.name for p in d.iterdir())
    capsys.readouterr()
    argv = ["certs", "issue", "--dir", str(d), "--role", role, "--name", "x", "--host", "h.example"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"error: hosts: {role} certificates only dial out, so they carry no host names; "
        "--host belongs to controller and scheduler certificates"
    )
    assert sorted(p.name for p in d.iterdir()) == before


def test_issue_refuses_a_reserved_role_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    capsys.readouterr()
    argv = ["certs", "issue", "--dir", str(d), "--role", "controller", "--name", "c2"]
    assert main([*argv, "--host", "scheduler.orka"]) == 1
    assert "error: hosts: 'scheduler.orka' is reserved" in capsys.readouterr().err
    crt = d / "controller-c2" / "controller-c2.crt"
    assert not crt.exists()
    assert main([*argv, "--host", "c2.example"]) == 0
    assert _dns(crt)[:1] == ["controller.orka"]
    assert "c2.example" in _dns(crt)


def test_init_host_goes_only_into_server_certs(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d), "--node", "n1", "--host", "api.example"]) == 0
    assert "api.example" in _dns(d / "controller" / "controller.crt")
    assert "api.example" in _dns(d / "scheduler" / "scheduler.crt")
    assert _dns(d / "admin.crt") == []
    assert _dns(d / "agent-n1" / "agent-n1.crt") == []


def test_server_without_its_role_name_does_not_start(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    assert check_tls(d, "scheduler", "scheduler", 5.0).cert == d / "scheduler" / "scheduler.crt"
    # A scheduler certificate from before role names (and before per-service folders): every
    # Orka client would refuse it, so the service refuses to start on it (check_tls is what
    # `orka scheduler` runs first).
    shutil.rmtree(d / "scheduler")
    write_legacy_cert(d, "scheduler", "scheduler", "scheduler")
    with pytest.raises(Invalid) as err:
        check_tls(d, "scheduler", "scheduler", 5.0)
    assert err.value.message == (
        f"certs: {d / 'scheduler.crt'} lacks the DNS name scheduler.orka that Orka's "
        "clients verify a scheduler by (issued by an older Orka?); re-issue it: "
        "orka certs issue --role scheduler --name scheduler"
    )
