"""The `orka` command: parse, dispatch to one command module, turn errors into exit codes.

Exit codes: 0 success, 1 a failed operation (`error: ...` on stderr), 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import grpc

from orka.cli import apply, certs, health, resources, services, up
from orka.cli.defaults import DEFAULT_IDENTITY, IDENTITY_HELP, UsageError, add_flag
from orka.errors import MORE_VIOLATIONS, OrkaError, PermissionDenied

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orka",
        description="Orka: a cluster control plane. Every flag also reads ORKA_<FLAG>.",
    )
    add_flag(parser, "--identity", metavar="NAME", default=DEFAULT_IDENTITY, help=IDENTITY_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    up.register(sub)
    services.register(sub)
    certs.register(sub)
    apply.register(sub)
    resources.register(sub)
    health.register(sub)
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
