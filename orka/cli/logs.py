"""`orka logs INSTANCE|WORKLOAD [-f] [--tail N] [--since DURATION|TIME]`: an instance's output
as its node keeps it (the controller's ReadLogs, relayed by the scheduler from the agent).

An instance's stdout goes to stdout and its stderr to stderr, byte for byte. A workload's
live instances are read together, each line prefixed with `[instance] ` (an instance that
starts later is not picked up: run the command again).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import time
from typing import BinaryIO

import grpc

from orka.api import controller_pb2 as pb
from orka.cli.client import AdminClient
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.cli.units import parse_duration
from orka.errors import Invalid, NotFound, from_rpc_error
from orka.models import TERMINAL_PHASES


def parse_since(value: str, now: float | None = None) -> float:
    """A duration back from now (`10s`, `5m`, `1h30m`) or an RFC 3339 time, to epoch seconds."""
    try:
        return (time.time() if now is None else now) - parse_duration(value, "--since")
    except Invalid:
        pass
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(
            f"--since: {value!r} is neither a duration (10s, 5m, 1h) nor a time"
            " (2026-01-02T15:04:05Z)"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()  # a local time, as people type it
    return when.timestamp()


def build_request(
    instance: str, follow: bool, tail: int | None, since: float | None
) -> pb.ReadLogsRequest:
    req = pb.ReadLogsRequest(instance=instance, follow=follow, tail_lines=tail or 0)
    if since is not None:
        req.since_time.FromNanoseconds(int(since * 1e9))
    return req


class Prefixer:
    """Whole lines of one instance's stream, each prefixed; a partial line waits for its end."""

    def __init__(self, prefix: bytes, out: BinaryIO) -> None:
        self.prefix = prefix
        self.out = out
        self.pending = b""

    def write(self, data: bytes) -> None:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            self.out.write(self.prefix + line + b"\n")
        self.out.flush()

    def close(self) -> None:
        if self.pending:
            self.out.write(self.prefix + self.pending + b"\n")
            self.out.flush()
            self.pending = b""


async def read(
    client: AdminClient, req: pb.ReadLogsRequest, stdout: BinaryIO, stderr: BinaryIO, prefix: bool
) -> None:
    outs: dict[int, Prefixer | BinaryIO] = {pb.LogChunk.STDOUT: stdout, pb.LogChunk.STDERR: stderr}
    if prefix:
        tag = f"[{req.instance}] ".encode()
        outs = {k: Prefixer(tag, v) for k, v in outs.items()}  # type: ignore[arg-type]
    try:
        async for chunk in client.stub.ReadLogs(req):
            out = outs.get(chunk.stream, stdout)
            out.write(chunk.data)
            if not prefix:
                out.flush()  # type: ignore[union-attr]
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from None
    finally:
        for out in outs.values():
            if isinstance(out, Prefixer):
                out.close()


async def _logs(args: argparse.Namespace) -> int:
    address, certs = client_target(args)
    since = parse_since(args.since) if args.since else None
    if args.tail == 0:
        since = time.time()  # no lines from before: only what comes next (with -f)
    stdout, stderr = sys.stdout.buffer, sys.stderr.buffer
    async with AdminClient(address, certs, identity=client_identity(args)) as client:
        try:
            # Also moves the client to the leader, which serves the stream.
            await client.get_instance(args.name)
            names = [args.name]
        except NotFound:
            try:
                await client.get_workload(args.name)
            except NotFound:
                raise NotFound(f"no instance or workload named {args.name!r}") from None
            live = await client.list_instances(workload=args.name)
            names = sorted(i.name for i in live if i.node and i.phase not in TERMINAL_PHASES)
            if not names:
                raise NotFound(f"workload {args.name!r} has no instance on a node") from None
        prefix = len(names) > 1 or names[0] != args.name
        await asyncio.gather(
            *(
                read(
                    client, build_request(n, args.follow, args.tail, since), stdout, stderr, prefix
                )
                for n in names
            )
        )
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    if args.tail is not None and args.tail < 0:
        raise UsageError(f"--tail: must be >= 0, got {args.tail}")
    return asyncio.run(_logs(args))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "logs",
        help="print an instance's (or a workload's instances') stdout and stderr",
        description=(
            "Print what an instance wrote, as its node keeps it (a size bound per stream, one "
            "rotated file). stdout goes to stdout, stderr to stderr. For a workload, each live "
            "instance's lines are prefixed with [instance]."
        ),
    )
    p.add_argument("name", metavar="INSTANCE|WORKLOAD")
    add_flag(p, "--follow", "-f", action="store_true", help="keep printing what is written next")
    add_flag(p, "--tail", type=int, metavar="N", help="start N lines before the end (0: none)")
    add_flag(p, "--since", metavar="DURATION|TIME", help="only output since (10s, 5m, or a time)")
    add_client_flags(p)
    p.set_defaults(func=cmd_logs)
