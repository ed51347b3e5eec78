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


def test_list_shows_each_certificate_and_whether_it_is_revoked(
    certs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import datetime as dt
    import json

    from orka.security.issue import issue_cert

    assert main(["certs", "issue", "--dir", str(certs), "--role", "viewer", "--name", "alice"]) == 0
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    issue_cert(
        certs, "admin", "old", not_valid_before=past, not_valid_after=past + dt.timedelta(days=1)
    )
    old_node = serial_of(certs, "agent", "node-1")
    # Rotate, then revoke the old serial: the list follows serials, not names.
    assert (
        main(["certs", "rotate", "--dir", str(certs), "--role", "agent", "--name", "node-1"]) == 0
    )
    assert main(["certs", "revoke", "--dir", str(certs), "--serial", f"{old_node:x}"]) == 0
    assert (
        main(["certs", "revoke", "--dir", str(certs), "--role", "viewer", "--name", "alice"]) == 0
    )
    capsys.readouterr()

    assert main(["certs", "list", "--dir", str(certs), "-o", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    got = {(c["role"], c["name"]): (c["serial"], c["revoked"], c["expired"]) for c in listed}
    want = {
        (role, name): (format(serial_of(certs, role, name), "x"), revoked, expired)
        for role, name, revoked, expired in [
            ("admin", "admin", False, False),
            ("admin", "old", False, True),
            ("viewer", "alice", True, False),
            ("agent", "node-1", False, False),
            ("controller", "controller", False, False),
            ("scheduler", "scheduler", False, False),
        ]
    }
    assert got == want
    assert len(listed) == len(want)
    assert all(Path(c["path"]).is_file() and c["not_after"].endswith("Z") for c in listed)

    assert main(["certs", "list", "--dir", str(certs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ROLE", "NAME", "SERIAL", "NOT-AFTER", "(UTC)", "REVOKED", "PATH"]
    alice = next(line.split() for line in lines if line.startswith("viewer"))
    assert alice[:3] == ["viewer", "alice", format(serial_of(certs, "viewer", "alice"), "x")]
    assert alice[-2:] == ["yes", str(certs / "viewer-alice.crt")]
    old = next(line for line in lines if " old " in line)
    assert "(expired)" in old and old.split()[-2] == "no"


def test_list_refuses_a_bad_format_and_a_missing_dir(
    certs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "list", "--dir", str(certs), "-o", "yaml"]) == 2
    assert "-o/--output: 'yaml' is not one of table, json" in capsys.readouterr().err
    assert main(["certs", "list", "--dir", str(tmp_path / "absent")]) == 1
    assert f"certs: {tmp_path / 'absent'} is not a directory" in capsys.readouterr().err
