"""The `orka` command: parse, dispatch to one command module, turn errors into exit codes.

Exit codes: 0 success, 1 a failed operation (`error: ...` on stderr), 2 a usage error,
130 interrupted (Ctrl-C, e.g. ending `orka get -w`). `orka apply --wait` also exits 2 when its
`--timeout` passes first and 1 when a workload cannot get ready (orka/cli/apply.py): 2 is kept
for usage errors too (argparse's convention, and a usage error applies nothing), so to a script
2 means "nothing failed; not done".
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

import grpc

from orka.cli.defaults import DEFAULT_IDENTITY, IDENTITY_HELP, UsageError, add_flag
from orka.errors import MORE_VIOLATIONS, OrkaError, PermissionDenied

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# Flags each command defines for itself that may also come before the command, as in
# `orka --controller X --certs D get nodes` (compose files and scripts put them there).
GLOBAL_FLAGS = ("--controller", "--certs", "--data-dir")

# The module of orka.cli that defines each command, in the order `orka --help` lists them.
# A command line that names a command loads only that module: a service's start (a scheduler
# restarted, an agent) or a CLI call then does not import every other command's dependencies
# (`up`'s process runtime and psutil, `apply`'s YAML), about a fifth of a second of imports.
COMMANDS: dict[str, str] = {
    "up": "up",
    "controller": "services",
    "scheduler": "services",
    "agent": "services",
    "certs": "certs",
    "apply": "apply",
    "get": "resources",
    "describe": "resources",
    "delete": "resources",
    "cordon": "resources",
    "uncordon": "resources",
    "drain": "resources",
    "health": "health",
    "rollout": "rollout",
    "top": "top",
    "logs": "logs",
    "exec": "exec",
    "console": "console",
}


def _split_at_command(argv: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The top-level flags before the command (each flag's name and its tokens), and the rest
    of `argv` from the command (or the first token that is no flag) on."""
    head: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if token in COMMANDS or not token.startswith("-"):
            return head, argv[i:]
        takes_value = "=" not in token and name in (*GLOBAL_FLAGS, "--identity")
        group = argv[i : i + 2] if takes_value else [token]
        head.append((name, group))
        i += len(group)
    return head, []


def command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` names, or None (none given, or none Orka knows)."""
    _, rest = _split_at_command(list(argv))
    return rest[0] if rest and rest[0] in COMMANDS else None


def hoist_global_flags(argv: list[str]) -> list[str]:
    """Move GLOBAL_FLAGS given before the command to the end, where the command parses them.

    A flag given both before and after the command: the one after wins (it is the more
    specific), so the one before is dropped. Flags the command does not take (say `--certs`
    for `orka up`) then fail as unknown, naming the flag.
    """
    head, rest = _split_at_command(argv)
    before = [t for name, group in head if name not in GLOBAL_FLAGS for t in group]
    given_after = {t.split("=", 1)[0] for t in rest}
    hoisted = [
        t for name, group in head if name in GLOBAL_FLAGS and name not in given_after for t in group
    ]
    # Options go before a `--` that ends them.
    end = rest.index("--") if "--" in rest else len(rest)
    return [*before, *rest[:end], *hoisted, *rest[end:]]


class OrkaParser(argparse.ArgumentParser):
    """The top-level parser: accepts GLOBAL_FLAGS before the command too."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(hoist_global_flags(argv), namespace)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `orka` parser: with every command, or with `command` and the others of its module
    only (enough to parse a command line that names it)."""
    parser = OrkaParser(
        prog="orka",
        description="Orka: a cluster control plane. Every flag also reads ORKA_<FLAG>.",
    )
    add_flag(parser, "--identity", metavar="NAME", default=DEFAULT_IDENTITY, help=IDENTITY_HELP)
    for flag in GLOBAL_FLAGS:
        # Listed for --help only: hoist_global_flags hands them to the command.
        parser.add_argument(
            flag, metavar="VALUE", default=argparse.SUPPRESS, help="also after the command"
        )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMANDS[command]] if command is not None else dict.fromkeys(COMMANDS.values())
    for module in modules:
        importlib.import_module(f"orka.cli.{module}").register(sub)
    return parser


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    line = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_of(line))
    try:
        args = parser.parse_args(line)
    except SystemExit as e:
        # argparse exits 2 on a usage error (after printing it) and 0 for --help.
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return func(args)
    except UsageError as e:
        _error(e.message)
        return EXIT_USAGE
    except PermissionDenied as e:
        # The controller's reason names the role; say first what kind of failure it is.
        _error(f"permission denied: {e.message}")
        return EXIT_FAILED
    except OrkaError as e:
        # A bad request names its fields (google.rpc.BadRequest): one line each.
        lines = [str(v) for v in e.violations()] or [e.message]
        if e.violations() and MORE_VIOLATIONS in e.metadata:
            lines.append(f"and {e.metadata[MORE_VIOLATIONS]} more")
        for line in lines:
            _error(line)
        return EXIT_FAILED
    except grpc.aio.AioRpcError as e:
        # Streams and calls that bypass orka.rpc.client still must not print a traceback.
        _error(f"{e.code().name}: {e.details()}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as e:
        _error(str(e))
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
