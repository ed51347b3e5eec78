"""`orka console INSTANCE`: attach to a VM's serial console; Ctrl-] detaches.

The controller's AttachConsole (admin only), relayed to the VM's agent, which attaches to the
serial port through libvirt. What the guest prints comes out on stdout; what is typed goes to
the guest, with the terminal in raw mode (so ^C reaches the guest, not this command). With
stdin not a terminal, what it carries is sent, and the output printed until interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator
from typing import BinaryIO

import grpc

from orka.api import controller_pb2 as pb
from orka.cli.client import AdminClient
from orka.cli.defaults import add_client_flags, client_identity, client_target
from orka.cli.exec import raw_terminal, read_stdin
from orka.errors import from_rpc_error

DETACH = b"\x1d"  # Ctrl-]


async def attach(client: AdminClient, instance: str, interactive: bool, stdout: BinaryIO) -> int:
    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[bytes] = asyncio.Queue()
    detached = asyncio.Event()

    async def requests() -> AsyncIterator[pb.AttachConsoleRequest]:
        yield pb.AttachConsoleRequest(instance=instance)
        threading.Thread(target=read_stdin, args=(loop, keys, DETACH), daemon=True).start()
        while data := await keys.get():
            if DETACH in data:
                before = data.split(DETACH, 1)[0]
                if before:
                    yield pb.AttachConsoleRequest(input=before)
                detached.set()
                return
            yield pb.AttachConsoleRequest(input=data)
        if interactive:
            detached.set()  # a terminal closed
        else:
            await asyncio.Event().wait()  # piped input ended: keep printing until interrupted

    call = client.stub.AttachConsole(requests())

    async def output() -> None:
        async for resp in call:
            stdout.write(resp.output)
            stdout.flush()

    reader = asyncio.create_task(output())
    waiter = asyncio.create_task(detached.wait())
    try:
        done, _ = await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if reader in done:
            reader.result()
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from None
    finally:
        waiter.cancel()
        reader.cancel()
        call.cancel()
    return 0


async def _console(args: argparse.Namespace) -> int:
    address, certs = client_target(args)
    interactive = os.isatty(0)
    async with AdminClient(address, certs, identity=client_identity(args)) as client:
        await client.get_instance(args.instance)  # NOT_FOUND early; moves to the leader
        if interactive:
            print(f"attached to {args.instance}; detach with Ctrl-]", file=sys.stderr)
        with raw_terminal(interactive):
            return await attach(client, args.instance, interactive, sys.stdout.buffer)


def cmd_console(args: argparse.Namespace) -> int:
    return asyncio.run(_console(args))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "console",
        help="attach to a VM's serial console (detach with Ctrl-])",
        description="Attach to INSTANCE's serial console (VMs only). Ctrl-] detaches.",
    )
    p.add_argument("instance", metavar="INSTANCE")
    add_client_flags(p)
    p.set_defaults(func=cmd_console)
