"""Default locations and the ORKA_* environment fallback shared by every command."""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path
from typing import Any

from dotenv import dotenv_values

from orka.errors import Invalid
from orka.security.ca import validate_name
from orka.security.issue import role_of_stem

DEFAULT_CONTROLLER = "127.0.0.1:7443"
DEFAULT_SCHEDULER = "127.0.0.1:7444"
# The certificate client commands present: `<certs>/<NAME>.crt/.key` (or its own folder).
DEFAULT_IDENTITY = "admin"
IDENTITY_HELP = (
    "which certificate of --certs to use: admin, or <role>-<name> as `orka certs issue` "
    "names it, e.g. viewer-alice (default admin)"
)
ENV_PREFIX = "ORKA_"
# A node's client defaults (the install guide writes it): ORKA_CONTROLLER and ORKA_CERTS, so that
# `orka get nodes` works there without flags. $ORKA_CLI_ENV names another file.
CLI_ENV_FILE = Path("/etc/orka/cli.env")
CLI_ENV_VARIABLE = "ORKA_CLI_ENV"
CLI_ENV_KEYS = ("ORKA_CONTROLLER", "ORKA_CERTS")
CLI_ENV_MAX_BYTES = 64 << 10


class UsageError(Exception):
    """A bad flag value found after argparse accepted the syntax; exits 2 like argparse does."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def env_value(flag: str) -> str | None:
    value = os.environ.get(env_name(flag))
    # An empty variable is how compose files and unit files "unset" a value.
    return value if value else None


def add_flag(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *aliases: str,
    default: Any = None,
    help: str = "",
    **kwargs: Any,
) -> None:
    """Add `flag`, defaulting to $ORKA_<FLAG> when set, else `default`.

    argparse runs `type` over string defaults, so a bad env value fails exactly like a bad
    flag value, naming the flag. An explicit flag always beats the environment.
    """
    env = env_value(flag)
    if env is not None and kwargs.get("action") not in ("append", "store_true"):
        default = env
    elif env is not None and kwargs.get("action") == "store_true":
        default = env.lower() in ("1", "true", "yes", "on")
    elif env is not None and kwargs.get("action") == "append":
        # argparse would append flags onto a non-empty default list, so the env value is
        # applied after parsing instead (see `append_from_env`).
        pass
    suffix = f" [env {env_name(flag)}]"
    parser.add_argument(*aliases, flag, default=default, help=(help + suffix).strip(), **kwargs)


def append_from_env(values: list[str] | None, flag: str) -> list[str]:
    """Repeatable flags: the flags if any were given, else the comma-separated env value."""
    if values:
        out: list[str] = []
        for v in values:
            out += [p.strip() for p in v.split(",") if p.strip()]
        return out
    env = env_value(flag)
    if env is None:
        return []
    return [p.strip() for p in env.split(",") if p.strip()]


def cli_env_path() -> Path:
    return Path(os.environ.get(CLI_ENV_VARIABLE) or CLI_ENV_FILE)


def cli_env() -> dict[str, str]:
    """The client defaults in the CLI env file (KEY=VALUE lines, # comments, as systemd's
    EnvironmentFile= reads them); {} when there is none. Read only by client commands, after
    parsing, so a broken file never stops a service."""
    path = cli_env_path()
    try:
        with path.open("rb") as f:
            data = f.read(CLI_ENV_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > CLI_ENV_MAX_BYTES:
        raise UsageError(
            f"{path}: larger than {CLI_ENV_MAX_BYTES >> 10} KiB; is it the right file?"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None
    values = dotenv_values(stream=io.StringIO(text))
    unknown = sorted(k for k in values if k not in CLI_ENV_KEYS)
    if unknown:
        raise UsageError(
            f"{path}: unknown variable {unknown[0][:64]!r}; it may set {' and '.join(CLI_ENV_KEYS)}"
        )
    return {k: v.strip() for k, v in values.items() if v and v.strip()}


def client_default(flag: str, builtin: str | None) -> str | None:
    """A client flag given neither on the command line nor as $ORKA_<FLAG> (add_flag put that
    in argparse's default): the CLI env file's value, else the built-in default."""
    return cli_env().get(env_name(flag)) or builtin


def default_data_dir() -> Path:
    env = env_value("--data-dir")
    return Path(env).expanduser() if env else Path.home() / ".orka"


def resolve_data_dir(value: str | Path | None) -> Path:
    return Path(value).expanduser() if value else default_data_dir()


def resolve_certs(value: str | Path | None, data_dir: Path) -> Path:
    return Path(value).expanduser() if value else data_dir / "certs"


def add_location_flags(parser: argparse.ArgumentParser) -> None:
    """--data-dir and --certs, which every command resolves the same way."""
    add_flag(parser, "--data-dir", metavar="DIR", help="Orka data directory (default ~/.orka)")
    add_flag(parser, "--certs", metavar="DIR", help="certs directory (default <data-dir>/certs)")


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    # No argparse defaults for --controller and --certs: client_target() fills them in, so
    # that the CLI env file is read only by the commands that use it.
    add_flag(
        parser,
        "--controller",
        metavar="HOST:PORT[,...]",
        help="controller address(es); the leader is found "
        f"(default: from {CLI_ENV_FILE}, else {DEFAULT_CONTROLLER})",
    )
    add_flag(parser, "--data-dir", metavar="DIR", help="Orka data directory (default ~/.orka)")
    add_flag(
        parser,
        "--certs",
        metavar="DIR",
        help=f"certs directory (default: from {CLI_ENV_FILE}, else <data-dir>/certs)",
    )
    # Also accepted before the command (`orka --identity viewer-alice get wl`), where its
    # default and $ORKA_IDENTITY live: SUPPRESS here keeps that value when not repeated.
    parser.add_argument("--identity", metavar="NAME", default=argparse.SUPPRESS, help=IDENTITY_HELP)


def client_identity(args: argparse.Namespace) -> tuple[str, str]:
    """The (role, name) of the certificate the client presents, from --identity."""
    value = str(getattr(args, "identity", DEFAULT_IDENTITY) or DEFAULT_IDENTITY).strip()
    role = role_of_stem(value)
    name = role if value == role else value[len(role) + 1 :] if role else ""
    try:
        if role is None or not name:
            raise Invalid("")
        validate_name(name)
    except Invalid:
        raise UsageError(
            f"--identity: {value[:64]!r} is not admin or <role>-<name> (e.g. viewer-alice), "
            "the name `orka certs issue --role ROLE --name NAME` writes"
        ) from None
    return role, name


def client_target(args: argparse.Namespace) -> tuple[str, Path]:
    """The controller address and certs dir a client command talks with: flags, then the
    environment, then the CLI env file, then the built-in defaults."""
    controller, source = args.controller, "--controller"
    if not controller:
        controller = client_default("--controller", DEFAULT_CONTROLLER)
        # A bad value from the file is named by the file, not by a flag nobody typed.
        if controller != DEFAULT_CONTROLLER:
            source = f"{cli_env_path()}: {env_name('--controller')}"
    controller = str(controller).strip()
    # Several controllers, comma-separated: the client follows whichever one leads.
    for one in controller.split(","):
        host, sep, port = one.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"{source}: {one.strip()!r} is not HOST:PORT")
    data_dir = resolve_data_dir(args.data_dir)
    return controller, resolve_certs(args.certs or client_default("--certs", None), data_dir)
