"""A node's client defaults: flags > environment > the CLI env file > built-in defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from orka.cli.defaults import CLI_ENV_MAX_BYTES, UsageError, client_target
from orka.cli.main import build_parser, main

FILE = "ORKA_CONTROLLER=ctl.example:7443\nORKA_CERTS=/etc/orka/certs\n"


@pytest.fixture(autouse=True)
def env_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("ORKA_CONTROLLER", "ORKA_CERTS", "ORKA_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "cli.env"
    monkeypatch.setenv("ORKA_CLI_ENV", str(path))
    return path


def target(*argv: str) -> tuple[str, Path]:
    return client_target(build_parser().parse_args(["get", "nodes", *argv]))


@pytest.mark.parametrize(
    ("file", "env", "argv", "expected"),
    [
        # built-in defaults: no file, no environment, no flags
        (None, {}, [], ("127.0.0.1:7443", "HOME/.orka/certs")),
        # the file beats the built-in defaults
        (FILE, {}, [], ("ctl.example:7443", "/etc/orka/certs")),
        # the environment beats the file, one variable at a time
        (FILE, {"ORKA_CONTROLLER": "10.0.0.1:1"}, [], ("10.0.0.1:1", "/etc/orka/certs")),
        (FILE, {"ORKA_CERTS": "/env/certs"}, [], ("ctl.example:7443", "/env/certs")),
        # flags beat both
        (
            FILE,
            {"ORKA_CONTROLLER": "10.0.0.1:1", "ORKA_CERTS": "/env/certs"},
            ["--controller", "h:2", "--certs", "/flag/certs"],
            ("h:2", "/flag/certs"),
        ),
        # a file setting one of them leaves the other at its default
        ("ORKA_CERTS=/etc/orka/certs\n", {}, [], ("127.0.0.1:7443", "/etc/orka/certs")),
        # as systemd's EnvironmentFile= reads it: comments, blank lines, quotes, empty = unset
        (
            '# written by the install guide\n\nORKA_CONTROLLER="ctl:7443"\nORKA_CERTS=\n',
            {},
            [],
            ("ctl:7443", "HOME/.orka/certs"),
        ),
        # an empty environment variable unsets, as for every ORKA_* variable
        (FILE, {"ORKA_CONTROLLER": ""}, [], ("ctl.example:7443", "/etc/orka/certs")),
    ],
)
def test_precedence(
    monkeypatch: pytest.MonkeyPatch,
    env_file: Path,
    tmp_path: Path,
    file: str | None,
    env: dict[str, str],
    argv: list[str],
    expected: tuple[str, str],
) -> None:
    if file is not None:
        env_file.write_text(file)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    controller, certs = target(*argv)
    assert (controller, str(certs)) == (
        expected[0],
        expected[1].replace("HOME", str(tmp_path / "home")),
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"ORKA_CONTROLLER=a:1\nORKA_LISTEN=0.0.0.0:1\n", "unknown variable 'ORKA_LISTEN'"),
        (b"ORKA_CONTROLER=a:1\n", "unknown variable 'ORKA_CONTROLER'"),
        (b"ORKA_CERTS=\xff\xfe\n", "not UTF-8 text"),
        (b"#" * (CLI_ENV_MAX_BYTES + 1), "larger than 64 KiB"),
        (b"ORKA_CONTROLLER=nohostport\n", "ORKA_CONTROLLER: 'nohostport' is not HOST:PORT"),
    ],
)
def test_bad_file_is_named(env_file: Path, content: bytes, message: str) -> None:
    env_file.write_bytes(content)
    with pytest.raises(UsageError, match=message) as err:
        target()
    assert err.value.message.startswith(f"{env_file}: ")


def test_services_never_read_it(env_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A broken client file must not stop a service from parsing its flags (or starting)."""
    env_file.write_text("ORKA_LISTEN=0.0.0.0:1\n")
    args = build_parser().parse_args(["scheduler"])
    assert (args.listen, args.certs) == ("127.0.0.1:7444", None)
    # A client command run with it fails with usage (2), naming the file.
    assert main(["get", "nodes"]) == 2
    assert f"error: {env_file}: unknown variable 'ORKA_LISTEN'" in capsys.readouterr().err
