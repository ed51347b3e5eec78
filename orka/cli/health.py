"""`orka health ADDR`: ask a controller or scheduler for its gRPC health (grpc.health.v1).

The probe of compose health checks and of anyone scripting a start-up: exit 0 when the server
answers SERVING, 1 otherwise with one line saying why (unreachable, refused, not serving, too
slow). It dials with mutual TLS like every Orka client. Every Orka server serves the standard
health service to any certificate of the cluster (orka/rpc/server.py: no role check on it, only
the revocation check), so a service's own pair works as the client certificate: a container
that mounts only `ca.crt` and its own pair can probe itself, and nothing needs `ca.key` or
`admin.key`. Agents serve nothing; an agent container probes its scheduler with its own
certificate, which proves the link it lives on (and that its certificate is not revoked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orka.cli.client import client_tls
from orka.cli.defaults import (
    DEFAULT_IDENTITY,
    UsageError,
    add_flag,
    client_identity,
    resolve_certs,
    resolve_data_dir,
)
from orka.errors import Invalid
from orka.rpc.client import refused_role, secure_channel, split_targets
from orka.security.issue import CA_CERT, role_of_stem
from orka.security.tls import TlsFiles

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
DEFAULT_TIMEOUT = 5.0
ROLES = ("controller", "scheduler")


class Unhealthy(Exception):
    """Why the server is not healthy, one line."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "health",
        help="check a controller's or scheduler's gRPC health (exit 0 when SERVING)",
        description=(
            "Ask ADDR for its grpc.health.v1 status over mutual TLS. Exit 0 when it is SERVING, "
            "1 otherwise with one line saying why. The client certificate is --identity's pair "
            "in --certs (default admin), or, when the dir holds no admin pair, its only pair: "
            "a service's own folder works, so `orka health 127.0.0.1:7443 --certs "
            "/certs` runs inside a container that mounts just ca.crt and its own pair."
        ),
    )
    p.add_argument("address", metavar="ADDR", help="HOST:PORT of a controller or scheduler")
    add_flag(
        p,
        "--role",
        default="auto",
        choices=("auto", *ROLES),
        help="the role the server must prove (auto: controller, else scheduler)",
    )
    add_flag(p, "--service", default="", help="the health service name to ask (default: server)")
    add_flag(
        p,
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up after this long (default {DEFAULT_TIMEOUT:g})",
    )
    add_flag(p, "--data-dir", metavar="DIR", help="Orka data directory (default ~/.orka)")
    add_flag(p, "--certs", metavar="DIR", help="certs directory (default <data-dir>/certs)")
    p.add_argument("--identity", metavar="NAME", default=argparse.SUPPRESS, help="see orka -h")
    p.set_defaults(func=run)


def only_pair(certs: Path) -> TlsFiles | None:
    """The one Orka pair lying in `certs` (a service's own folder), or None."""
    pairs = [
        crt
        for crt in sorted(certs.glob("*.crt"))
        if crt.name != CA_CERT
        and role_of_stem(crt.stem) is not None
        and crt.with_suffix(".key").is_file()
    ]
    if len(pairs) != 1 or not (certs / CA_CERT).is_file():
        return None
    return TlsFiles(ca=certs / CA_CERT, cert=pairs[0], key=pairs[0].with_suffix(".key"))


def probe_tls(certs: Path, identity: tuple[str, str]) -> TlsFiles:
    """The pair to present: the asked-for identity, or with the default (admin) absent, the
    dir's only pair."""
    try:
        return client_tls(certs, identity)
    except Invalid:
        if identity != (DEFAULT_IDENTITY, DEFAULT_IDENTITY):
            raise
        found = only_pair(certs)
        if found is None:
            raise
        return found


async def check_once(
    address: str, tls: TlsFiles, role: str, service: str, timeout: float
) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    async with secure_channel(address, tls, role, max_receive=None) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status


async def check(
    address: str, tls: TlsFiles, roles: tuple[str, ...], service: str, timeout: float
) -> str:
    """The role the server proved when it is SERVING; raises Unhealthy otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    refusals: list[str] = []
    for role in roles:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            status = await check_once(address, tls, role, service, left)
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details() or ""
            refused = refused_role(details, role) if code is grpc.StatusCode.UNAVAILABLE else None
            if refused is not None:
                refusals.append(refused)
                continue  # maybe the other role's server
            raise Unhealthy(_why(address, code, details, timeout)) from None
        if status == health_pb2.HealthCheckResponse.SERVING:
            return role
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        raise Unhealthy(f"{address} ({role}) is {name}")
    if refusals:
        raise Unhealthy(f"refusing the server at {address}: {'; '.join(refusals)}")
    raise Unhealthy(f"{address} did not answer within {timeout:g}s")


def _why(address: str, code: grpc.StatusCode, details: str, timeout: float) -> str:
    details = " ".join(details.split())[:300]  # one line, bounded
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{address} did not answer within {timeout:g}s"
    if code is grpc.StatusCode.NOT_FOUND:
        return f"{address} has no health status for that --service ({details})"
    if code is grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach {address}: {details}"
    return f"{address}: {code.name}: {details}"


@contextlib.contextmanager
def _quiet_grpc_core() -> Iterator[None]:
    """gRPC core logs a failed handshake on stderr (fd 2, from C++) before the call fails;
    the probe's answer is its one line, so that noise goes to /dev/null while it runs.
    GRPC_VERBOSITY cannot do it: it is read when `grpc` is imported, long before this. Set it
    yourself (any value) to see gRPC core's logs again."""
    if "GRPC_VERBOSITY" in os.environ:
        yield
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        raise UsageError(f"--timeout: must be > 0, got {args.timeout:g}")
    try:
        split_targets(args.address, "ADDR")
    except Invalid as e:
        raise UsageError(e.message) from None
    certs = resolve_certs(args.certs, resolve_data_dir(args.data_dir))
    tls = probe_tls(certs, client_identity(args))
    roles = ROLES if args.role == "auto" else (args.role,)
    try:
        with _quiet_grpc_core():
            role = asyncio.run(check(args.address, tls, roles, args.service, args.timeout))
    except Unhealthy as e:
        print(f"unhealthy: {e}")
        return EXIT_NOT_SERVING
    print(f"{args.address} ({role}): SERVING")
    return EXIT_SERVING
