"""`orka exec INSTANCE [-t] [-i] -- CMD...`: run a command inside a running instance.

The controller's ExecInstance (admin only), relayed by the scheduler to the instance's agent,
which runs it through its driver (containerd's exec for containers; for processes the
instance's user, environment, working dir, cgroup and network). The command's stdout and
stderr come out on ours, and `orka exec` exits with its exit code. `-i` sends our stdin to it
(end of file closes its stdin); `-t` gives it a terminal (our terminal in raw mode, its size
kept in step), where stdout and stderr are one stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import termios
import threading
import tty
from collections.abc import AsyncIterator, Iterator
from typing import BinaryIO

import grpc

from orka.api import controller_pb2 as pb
from orka.cli.client import AdminClient
from orka.cli.defaults import UsageError, add_client_flags, add_flag, client_identity, client_target
from orka.errors import from_rpc_error

READ_SIZE = 32 << 10


def terminal_size() -> pb.TerminalSize:
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except OSError:
        return pb.TerminalSize()
    return pb.TerminalSize(rows=size.lines, cols=size.columns)


def read_stdin(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[bytes], until: bytes = b""
) -> None:
    """A daemon thread (a blocking read of fd 0 must not hold up the exit): stdin's chunks
    into `queue`, waiting for room (a bounded queue holds the reader back, not the loop), then
    b"" at its end; it stops after a chunk holding `until` (the console's detach key)."""
    while True:
        try:
            data = os.read(0, READ_SIZE)
        except OSError:
            data = b""
        asyncio.run_coroutine_threadsafe(queue.put(data), loop).result()
        if not data or (until and until in data):
            return


async def requests(
    start: pb.ExecStart, interactive: bool, resized: asyncio.Queue[pb.TerminalSize]
) -> AsyncIterator[pb.ExecInstanceRequest]:
    yield pb.ExecInstanceRequest(start=start)
    if not interactive:
        return
    loop = asyncio.get_running_loop()
    data_q: asyncio.Queue[bytes] = asyncio.Queue(4)
    threading.Thread(target=read_stdin, args=(loop, data_q), daemon=True).start()
    while True:
        get_data = asyncio.ensure_future(data_q.get())
        get_size = asyncio.ensure_future(resized.get())
        done, _ = await asyncio.wait({get_data, get_size}, return_when=asyncio.FIRST_COMPLETED)
        if get_size in done:
            yield pb.ExecInstanceRequest(resize=get_size.result())
        else:
            get_size.cancel()
        if get_data in done:
            data = get_data.result()
            if not data:
                yield pb.ExecInstanceRequest(close_stdin=True)
                # Keep the request stream open: closing it is not the end of the command.
                await asyncio.Event().wait()
            yield pb.ExecInstanceRequest(stdin=data)
        else:
            get_data.cancel()


@contextlib.contextmanager
def raw_terminal(enabled: bool) -> Iterator[None]:
    if not enabled or not os.isatty(0):
        yield
        return
    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        yield
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


async def run_exec(
    client: AdminClient,
    start: pb.ExecStart,
    interactive: bool,
    stdout: BinaryIO,
    stderr: BinaryIO,
) -> int:
    resized: asyncio.Queue[pb.TerminalSize] = asyncio.Queue()
    if start.tty:
        with contextlib.suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGWINCH, lambda: resized.put_nowait(terminal_size())
            )
    code = 1
    try:
        async for resp in client.stub.ExecInstance(requests(start, interactive, resized)):
            kind = resp.WhichOneof("body")
            if kind == "stdout":
                stdout.write(resp.stdout)
                stdout.flush()
            elif kind == "stderr":
                stderr.write(resp.stderr)
                stderr.flush()
            elif kind == "exit_code":
                code = resp.exit_code
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from None
    return code


async def _exec(args: argparse.Namespace, command: list[str]) -> int:
    address, certs = client_target(args)
    start = pb.ExecStart(
        instance=args.instance, command=command, tty=args.tty, stdin=args.interactive
    )
    if args.tty:
        start.size.CopyFrom(terminal_size())
    async with AdminClient(address, certs, identity=client_identity(args)) as client:
        await client.get_instance(args.instance)  # NOT_FOUND early; moves to the leader
        with raw_terminal(args.tty and args.interactive):
            return await run_exec(
                client, start, args.interactive, sys.stdout.buffer, sys.stderr.buffer
            )


def _flags_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orka exec", add_help=False)
    _add_flags(p)
    return p


def _add_flags(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--interactive", "-i", action="store_true", help="send stdin to the command")
    add_flag(p, "--tty", "-t", action="store_true", help="give the command a terminal")
    add_client_flags(p)


def cmd_exec(args: argparse.Namespace) -> int:
    command = list(args.command)
    if "--" in command:
        # argparse hands over everything after INSTANCE: flags given there (before `--`) are
        # ours, the rest is the command's.
        at = command.index("--")
        flags, command = command[:at], command[at + 1 :]
        given = _flags_parser().parse_args(flags)
        for key, value in vars(given).items():
            if value not in (None, False) or getattr(args, key, None) is None:
                setattr(args, key, value)
    if not command:
        raise UsageError("exec: a command is required: orka exec INSTANCE -- CMD...")
    return asyncio.run(_exec(args, command))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "exec",
        help="run a command inside a running instance",
        description=(
            "Run CMD inside INSTANCE (a container through containerd, a process in the "
            "instance's user, environment, cgroup and network) and exit with its exit code."
        ),
    )
    p.add_argument("instance", metavar="INSTANCE")
    _add_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...")
    p.set_defaults(func=cmd_exec)
