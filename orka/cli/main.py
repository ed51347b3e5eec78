"""The `orka` command: parse, dispatch to one command module, turn errors into exit codes.

Exit codes: 0 success, 1 a failed operation (`error: ...` on stderr), 2 a usage error,
130 interrupted (Ctrl-C, e.g. ending `orka get -w`). `orka apply --wait` also exits 2 when its
`--timeout` passes first and 1 when a workload cannot get ready (orka/cli/apply.py): 2 is kept
for usage errors too (argparse's convention, and a usage error applies nothing), so to a script
2 means "nothing failed; not done".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import grpc

from orka.cli import apply, certs, console, health, logs, resources, rollout, services, top, up
from orka.cli import exec as exec_cmd
from orka.cli.defaults import DEFAULT_IDENTITY, IDENTITY_HELP, UsageError, add_flag
from orka.errors import MORE_VIOLATIONS, OrkaError, PermissionDenied

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# Flags each command defines for itself that may also come before the command, as in
# `orka --controller X --certs D get nodes` (compose files and scripts put them there).
GLOBAL_FLAGS = ("--controller", "--certs", "--data-dir")


def hoist_global_flags(argv: list[str], commands: set[str]) -> list[str]:
    """Move GLOBAL_FLAGS given before the command to the end, where the command parses them.

    A flag given both before and after the command: the one after wins (it is the more
    specific), so the one before is dropped. Flags the command does not take (say `--certs`
    for `orka up`) then fail as unknown, naming the flag.
    """
    head: list[tuple[str, list[str]]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if token in commands or not token.startswith("-"):
            rest = argv[i:]
            break
        takes_value = "=" not in token and name in (*GLOBAL_FLAGS, "--identity")
        group = argv[i : i + 2] if takes_value else [token]
        head.append((name, group))
        i += len(group)
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

    commands: set[str] = set()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(hoist_global_flags(argv, self.commands), namespace)


def build_parser() -> argparse.ArgumentParser:
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
    up.register(sub)
    services.register(sub)
    certs.register(sub)
    apply.register(sub)
    resources.register(sub)
    health.register(sub)
    rollout.register(sub)
    top.register(sub)
    logs.register(sub)
    exec_cmd.register(sub)
    console.register(sub)
    parser.commands = set(sub.choices)
    return parser


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
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
