"""`orka COMMAND` loads only COMMAND's module, and the table that says which one that is stays
true to what each module registers."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest

from orka.cli.main import COMMANDS, build_parser, command_of
from tests.subprocs import fresh_python


def test_each_module_registers_exactly_the_commands_the_table_gives_it() -> None:
    for module in dict.fromkeys(COMMANDS.values()):
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"orka.cli.{module}").register(sub)
        assert set(sub.choices) == {c for c, m in COMMANDS.items() if m == module}, module


def test_the_full_parser_lists_every_command_in_the_tables_order() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)


def test_a_parser_for_one_command_holds_its_modules_commands_only() -> None:
    parser = build_parser("cordon")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["get", "describe", "delete", "cordon", "uncordon", "drain"]
    # Flags before the command are still moved after it: the hoisting knows every command.
    args = parser.parse_args(["--controller", "h:1", "cordon", "n1"])
    assert (args.command, args.controller) == ("cordon", "h:1")


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["scheduler", "--listen", "0.0.0.0:1"], "scheduler"),
        (["--certs", "/d", "--controller", "h:1", "get", "nodes"], "get"),
        (["--certs=/d", "apply", "-f", "x.yaml"], "apply"),
        (["--identity", "ops", "drain", "n1"], "drain"),
        # A flag's value that happens to be a command's name is not the command.
        (["--data-dir", "logs", "top"], "top"),
        ([], None),
        (["--help"], None),
        (["bogus", "get"], None),
        (["--certs", "/d"], None),
    ],
)
def test_the_command_a_line_names(argv: list[str], command: str | None) -> None:
    assert command_of(argv) == command


def _loaded_by(argv: list[str]) -> set[str]:
    """The orka.cli and store modules a fresh interpreter holds after `orka ARGV`."""
    code = (
        "import json, sys\n"
        "from orka.cli.main import main\n"
        f"main({argv!r})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('orka.', 'yaml',"
        " 'aetcd', 'psutil')))))\n"
    )
    out = fresh_python(code)
    return set(json.loads(out.splitlines()[-1]))


def test_a_service_start_loads_no_other_commands_module() -> None:
    # Through the start itself (its imports), up to a flag it refuses before it listens.
    loaded = _loaded_by(["scheduler", "--election-ttl", "1"])
    assert {"orka.cli.main", "orka.cli.services"} <= loaded
    others = {f"orka.cli.{m}" for m in COMMANDS.values()} - {"orka.cli.services"}
    assert not loaded & others
    assert not loaded & {"yaml", "psutil", "orka.runtime.process"}


def test_help_without_a_command_lists_them_all(capsys: pytest.CaptureFixture[str]) -> None:
    from orka.cli.main import main

    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    for command in COMMANDS:
        assert f"\n    {command} " in listed, command


def test_an_unknown_command_names_every_known_one(capsys: pytest.CaptureFixture[str]) -> None:
    from orka.cli.main import EXIT_USAGE, main

    assert main(["scheduler-x"]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert "invalid choice: 'scheduler-x'" in error
    assert all(f"'{command}'" in error for command in COMMANDS)


def test_a_scheduler_alone_loads_neither_etcds_client_nor_sqlite() -> None:
    code = (
        "import json, sys\n"
        "import orka.scheduler.service, orka.store\n"
        "before = sorted(m for m in ('aetcd', 'orka.store.etcd', 'orka.store.sqlite')"
        " if m in sys.modules)\n"
        "from orka.store import EtcdStore, SqliteStore, open_store\n"
        "print(json.dumps([before, EtcdStore.__module__, SqliteStore.__module__,"
        " open_store.__module__]))\n"
    )
    out = fresh_python(code)
    before, *modules = json.loads(out)
    assert before == []
    # The package's names still resolve, on first use.
    assert modules == ["orka.store.etcd", "orka.store.sqlite", "orka.store.factory"]


def test_the_store_package_names_what_it_lacks() -> None:
    import orka.store

    with pytest.raises(AttributeError, match=r"'orka\.store' has no attribute 'Nope'"):
        orka.store.Nope  # noqa: B018
