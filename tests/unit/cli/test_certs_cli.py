"""`orka certs revoke` and `orka certs rotate` as a user types them."""

from __future__ import annotations

from pathlib import Path

import pytest

from orka.cli.main import main
from orka.security.revoke import current_crl, serial_of


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d), "--node", "node-1"]) == 0
    return d


def test_revoke_by_name_and_by_serial(certs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = serial_of(certs, "agent", "node-1")
    admin = serial_of(certs, "admin", "admin")
    capsys.readouterr()
    assert (
        main(["certs", "revoke", "--dir", str(certs), "--role", "agent", "--name", "node-1"]) == 0
    )
    out = capsys.readouterr().out
    assert f"revoked agent/node-1 (serial {node:x})" in out
    assert f"wrote {certs / 'agent-node-1' / 'crl.pem'}" in out
    assert main(["certs", "revoke", "--dir", str(certs), "--serial", f"{admin:X}"]) == 0
    crl = current_crl(certs)
    assert crl is not None and {e.serial_number for e in crl} == {node, admin}
    assert main(["certs", "revoke", "--dir", str(certs), "--serial", f"{admin:x}"]) == 0
    assert "was already revoked" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "rc", "message"),
    [
        ([], 2, "give either --role and --name, or --serial"),
        (["--role", "agent", "--name", "node-1", "--serial", "1"], 2, "give either"),
        (["--role", "agent"], 2, "both are required"),
        (["--serial", "xyz"], 1, "serial: 'xyz' is not a hexadecimal number"),
        (["--role", "agent", "--name", "node-9"], 1, "no certificate for agent 'node-9'"),
    ],
)
def test_revoke_refuses(
    certs: Path, capsys: pytest.CaptureFixture[str], args: list[str], rc: int, message: str
) -> None:
    capsys.readouterr()
    assert main(["certs", "revoke", "--dir", str(certs), *args]) == rc
    assert message in capsys.readouterr().err
    assert not (certs / "crl.pem").exists()  # nothing written on a refusal


def test_rotate(certs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = serial_of(certs, "scheduler", "scheduler")
    capsys.readouterr()
    assert (
        main(["certs", "rotate", "--dir", str(certs), "--role", "scheduler", "--name", "scheduler"])
        == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {certs / 'scheduler' / 'scheduler.crt'}",
        f"wrote {certs / 'scheduler' / 'scheduler.key'}",
    ]
    assert serial_of(certs, "scheduler", "scheduler") != before
    assert main(["certs", "rotate", "--dir", str(certs), "--all"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 8
    assert main(["certs", "rotate", "--dir", str(certs)]) == 2
    assert "give either --role and --name, or --all" in capsys.readouterr().err
