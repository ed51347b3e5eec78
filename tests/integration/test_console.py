"""`orka console` on a real VM (libvirt, QEMU under TCG, the test guest of libvirt_env): the
guest's boot output is shown, what is typed reaches its shell, and the console log keeps
being written while attached."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.rpc.client import call
from tests.integration.cluster import Cluster, eventually
from tests.integration.orka_cli import orka_cmd, orka_env
from tests.libvirt_env import DOMAIN_TYPE, MARKER, Guest, LibvirtDaemons, needs_libvirt

pytestmark = [needs_libvirt, pytest.mark.timeout(600)]

BOOT_TIMEOUT = 180.0


async def test_console_shows_boot_output_and_takes_input(
    certs_dir: Path, tmp_path: Path, libvirt_daemons: LibvirtDaemons, guest: Guest
) -> None:
    c = Cluster(certs_dir, tmp_path)
    proc: asyncio.subprocess.Process | None = None
    try:
        await c.start(
            agents=1,
            runtimes=["libvirt"],
            driver_options={
                "libvirt": {
                    "uri": libvirt_daemons.uri,
                    "poll_interval": 0.2,
                    "domain_type": DOMAIN_TYPE,
                }
            },
            allowed_paths=[guest.kernel.parent, guest.initrd.parent],
        )
        assert c.api is not None
        spec = pb.WorkloadSpec(
            name="vmc",
            kind=pb.WorkloadSpec.VM,
            vm=pb.VmSpec(
                kernel=str(guest.kernel), initrd=str(guest.initrd), cmdline=guest.cmdline()
            ),
            replicas=1,
            resources=pb.Resources(cpu_millis=500, memory_bytes=128 << 20),
        )
        await call(c.api.CreateWorkload, pb.CreateWorkloadRequest(spec=spec))
        (inst,) = await eventually(lambda: c.running("vmc"), timeout=BOOT_TIMEOUT)

        proc = await asyncio.create_subprocess_exec(
            *orka_cmd(c, "console", inst.name),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=orka_env(),
        )
        assert proc.stdin is not None and proc.stdout is not None
        seen = b""

        async def until(text: bytes) -> None:
            nonlocal seen
            async with asyncio.timeout(BOOT_TIMEOUT):
                while text not in seen:
                    chunk = await proc.stdout.read(4096)  # type: ignore[union-attr]
                    assert chunk, (seen[-2000:], await proc.stderr.read())  # type: ignore[union-attr]
                    seen += chunk

        # The guest's boot output (its init proves it is the guest talking).
        await until(f"{MARKER} kernel=".encode())
        # Typed input reaches the guest's shell; its answer comes back.
        proc.stdin.write(b"echo typed-$((6*7))\n")
        await proc.stdin.drain()
        await until(b"typed-42")
        # The console log keeps being written while attached.
        agent = c.agents["node-1"]
        console_log, _ = agent.instances[inst.name].driver.log_paths(inst.name)
        await eventually(
            lambda: asyncio.to_thread(lambda: b"typed-42" in console_log.read_bytes()), timeout=10
        )

        # An unknown instance: NOT_FOUND.
        async def first(name: str):  # type: ignore[no-untyped-def]
            yield pb.AttachConsoleRequest(instance=name)

        with pytest.raises(grpc.aio.AioRpcError) as missing:
            async for _ in c.api.AttachConsole(first("ghost-1")):
                pass
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await c.stop()
