"""`orka console` on a running VM of a Cluster: what test_libvirt's end-to-end scenario checks
on the VM it has booted anyway (a second boot would cost CI half a minute)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orka.api import controller_pb2 as pb
from tests.integration.cluster import Cluster, eventually
from tests.integration.orka_cli import orka, orka_cmd, orka_env
from tests.libvirt_env import MARKER


async def check_console(c: Cluster, instance: str, timeout: float) -> None:
    """The guest's boot output is shown (the console starts with the log's recent part), a
    typed command reaches the guest's shell and its answer comes back, the console log keeps
    being written, and an unknown instance is NOT_FOUND."""
    assert c.api is not None
    proc = await asyncio.create_subprocess_exec(
        *orka_cmd(c, "console", instance),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=orka_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    seen = b""

    async def until(text: bytes) -> None:
        nonlocal seen
        async with asyncio.timeout(timeout):
            while text not in seen:
                chunk = await proc.stdout.read(4096)  # type: ignore[union-attr]
                assert chunk, (seen[-2000:], await proc.stderr.read())  # type: ignore[union-attr]
                seen += chunk

    try:
        await until(f"{MARKER} kernel=".encode())
        proc.stdin.write(b"echo typed-$((6*7))\n")
        await proc.stdin.drain()
        await until(b"typed-42")
        console_log, _ = (
            next(iter(c.agents.values())).instances[instance].driver.log_paths(instance)
        )
        await eventually(
            lambda: asyncio.to_thread(lambda: b"typed-42" in console_log.read_bytes()), timeout=10
        )
        # A VM's console log is its stdout for `orka logs`.
        code, out, _ = await orka(c, "logs", "--tail", "20", instance)
        assert code == 0 and b"typed-42" in out and f"{MARKER} kernel=".encode() in out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def first(name: str):  # type: ignore[no-untyped-def]
        yield pb.AttachConsoleRequest(instance=name)

    with pytest.raises(grpc.aio.AioRpcError) as missing:
        async for _ in c.api.AttachConsole(first("ghost-1")):
            pass
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
