"""`orka certs init|issue|revoke|rotate|list`: the cluster CA and each identity's certificate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from orka.cli import output
from orka.cli.defaults import (
    UsageError,
    add_flag,
    append_from_env,
    env_value,
    resolve_certs,
    resolve_data_dir,
)
from orka.security.inventory import list_certs
from orka.security.issue import init_certs, issue_cert
from orka.security.revoke import parse_serial, revoke, serial_of
from orka.security.rotate import rotate


def _dir(args: argparse.Namespace) -> Path:
    if args.dir:
        return Path(args.dir).expanduser()
    # Same place `orka up` and the client commands look, so the defaults line up.
    return resolve_certs(env_value("--certs"), resolve_data_dir(None))


def _report(paths: list[Path], dir: Path) -> None:
    if not paths:
        print(f"nothing to do: every certificate already exists in {dir}")
        return
    for p in paths:
        print(f"wrote {p}")


def cmd_init(args: argparse.Namespace) -> int:
    dir = _dir(args)
    nodes = append_from_env(args.node, "--node")
    hosts = append_from_env(args.host, "--host")
    _report(init_certs(dir, nodes=nodes, extra_hosts=hosts), dir)
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    if not args.role:
        raise UsageError("--role: is required (controller, scheduler, agent, admin or viewer)")
    if not args.name:
        raise UsageError("--name: is required")
    dir = _dir(args)
    _report(issue_cert(dir, args.role, args.name, append_from_env(args.host, "--host")), dir)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    by_name = args.role is not None or args.name is not None
    if by_name == (args.serial is not None):
        raise UsageError("give either --role and --name, or --serial")
    if by_name and not (args.role and args.name):
        raise UsageError("--role and --name: both are required")
    dir = _dir(args)
    serial = serial_of(dir, args.role, args.name) if by_name else parse_serial(args.serial)
    new, paths = revoke(dir, [serial])
    what = f"{args.role}/{args.name}" if by_name else "certificate"
    if new:
        print(
            f"revoked {what} (serial {serial:x}); services refuse it within their reload interval"
        )
    else:
        print(f"{what} (serial {serial:x}) was already revoked")
    _report(paths, dir)
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    by_name = args.role is not None or args.name is not None
    if by_name == bool(args.all):
        raise UsageError("give either --role and --name, or --all")
    if by_name and not (args.role and args.name):
        raise UsageError("--role and --name: both are required")
    dir = _dir(args)
    _report(rotate(dir, role=args.role, name=args.name), dir)
    return 0


LIST_FORMATS = ("table", "json")


def cmd_list(args: argparse.Namespace) -> int:
    if args.output not in LIST_FORMATS:
        raise UsageError(f"-o/--output: {args.output[:32]!r} is not one of table, json")
    infos = list_certs(_dir(args))
    if args.output == "json":
        print(json.dumps([i.model_dump(mode="json") for i in infos], indent=2))
        return 0
    rows = [
        (
            i.role,
            i.name,
            i.serial,
            i.not_after.strftime("%Y-%m-%d %H:%M") + (" (expired)" if i.expired else ""),
            "yes" if i.revoked else "no",
            i.path,
        )
        for i in infos
    ]
    print(output.table(["ROLE", "NAME", "SERIAL", "NOT-AFTER (UTC)", "REVOKED", "PATH"], rows))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("certs", help="create the cluster CA and certificates")
    csub = p.add_subparsers(dest="certs_command", metavar="init|issue|revoke|rotate|list")
    csub.required = True

    init = csub.add_parser("init", help="CA + controller, scheduler, admin and agent certs")
    add_flag(init, "--dir", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    add_flag(init, "--node", action="append", metavar="NAME", help="agent cert per node")
    add_flag(init, "--host", action="append", metavar="H", help="extra DNS name or IP")
    init.set_defaults(func=cmd_init)

    issue = csub.add_parser("issue", help="issue (or re-issue) one certificate")
    add_flag(issue, "--dir", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    add_flag(issue, "--role", metavar="ROLE", help="controller, scheduler, agent, admin or viewer")
    add_flag(issue, "--name", metavar="NAME", help="the identity's name, e.g. the node name")
    add_flag(issue, "--host", action="append", metavar="H", help="extra DNS name or IP")
    issue.set_defaults(func=cmd_issue)

    revoke_p = csub.add_parser("revoke", help="revoke a certificate (services refuse it)")
    add_flag(revoke_p, "--dir", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    add_flag(revoke_p, "--role", metavar="ROLE", help="the role of the certificate to revoke")
    add_flag(revoke_p, "--name", metavar="NAME", help="its name (the one it was issued to)")
    add_flag(revoke_p, "--serial", metavar="HEX", help="or its serial number, in hex")
    revoke_p.set_defaults(func=cmd_revoke)

    rot = csub.add_parser("rotate", help="re-issue certificates in place (never the CA)")
    add_flag(rot, "--dir", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    add_flag(rot, "--role", metavar="ROLE", help="the role of the certificate to re-issue")
    add_flag(rot, "--name", metavar="NAME", help="its name")
    add_flag(rot, "--all", action="store_true", help="every certificate in DIR")
    rot.set_defaults(func=cmd_rotate)

    ls = csub.add_parser("list", help="each certificate: role, name, serial, expiry, revoked")
    add_flag(ls, "--dir", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    add_flag(ls, "--output", "-o", default="table", help="table or json", metavar="FORMAT")
    ls.set_defaults(func=cmd_list)
