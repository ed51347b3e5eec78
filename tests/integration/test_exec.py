"""A real containerd container through the whole path: `orka logs` gets its stdout and
stderr apart, and `orka exec` runs commands in it (output, stdin, exit codes)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from orka.api import controller_pb2 as pb
from orka.rpc.client import call
from tests.containerd_env import Containerd, needs_containerd
from tests.integration.cluster import Cluster, eventually
from tests.integration.orka_cli import orka, orka_cmd, orka_env

pytestmark = needs_containerd

TALK = "i=0; while :; do i=$((i+1)); echo out $i; echo err $i >&2; sleep 0.1; done"


async def test_container_logs_apart_and_exec(
    containerd: Containerd, certs_dir: Path, tmp_path: Path
) -> None:
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start(
            agents=1,
            runtimes=["containerd"],
            driver_options={"containerd": containerd.options()},
            allowed_paths=containerd.allowed_paths(),
        )
        assert c.api is not None
        spec = pb.WorkloadSpec(
            name="box",
            kind=pb.WorkloadSpec.CONTAINER,
            image=containerd.image,
            command=["sh", "-c", TALK],
            replicas=1,
            # An exec check runs through containerd's exec, like `orka exec`.
            health_check=pb.HealthCheck(
                exec=pb.HealthCheck.Exec(command=["cat", "/etc/hostname"]),
                interval=Duration(seconds=1),
                timeout=Duration(seconds=1),
            ),
        )
        await call(c.api.CreateWorkload, pb.CreateWorkloadRequest(spec=spec))
        (inst,) = await eventually(lambda: c.running("box"))
        name = inst.name

        async def healthy() -> pb.Instance | None:
            got = await call(c.api.GetInstance, pb.GetInstanceRequest(name=name))
            return got if got.health == pb.Instance.HEALTHY else None

        assert (await eventually(healthy, timeout=20)).restarts == 0

        # Logs: stdout and stderr of a container arrive apart, each on its own output.
        async def three_lines() -> tuple[bytes, bytes] | None:
            code, out, err = await orka(c, "logs", "--tail", "3", name)
            assert code == 0, err
            return (out, err) if out.count(b"\n") == 3 and err.count(b"\n") == 3 else None

        out, err = await eventually(three_lines, timeout=20, interval=0.3)
        assert all(re.fullmatch(rb"out \d+", line) for line in out.splitlines()), out
        assert all(re.fullmatch(rb"err \d+", line) for line in err.splitlines()), err

        # Follow from now (--tail 0): only lines written from here on, as they are written.
        last = int(out.splitlines()[-1].split()[1])
        follow = await asyncio.create_subprocess_exec(
            *orka_cmd(c, "logs", "-f", "--tail", "0", name),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=orka_env(),
        )
        assert follow.stdout is not None
        try:
            async with asyncio.timeout(20):
                while True:
                    line = await follow.stdout.readline()
                    assert re.fullmatch(rb"out \d+\n", line), line
                    # Nothing from long before: "from now" is found in the size index,
                    # sampled once a second (10 lines at this rate), so up to about a second
                    # of older lines may come first (CI saw 3), never the whole file.
                    assert int(line.split()[1]) > max(1, last - 15), (line, last)
                    if int(line.split()[1]) > last + 3:
                        break
        finally:
            follow.kill()
            await follow.wait()

        # Exec: output and exit code, a failing command's stderr and code, stdin.
        code, out, err = await orka(c, "exec", name, "--", "cat", "/etc/hostname")
        assert (code, out, err) == (0, f"{name}\n".encode(), b"")
        code, out, err = await orka(c, "exec", name, "--", "sh", "-c", "echo bad >&2; exit 3")
        assert (code, out, err) == (3, b"", b"bad\n")
        code, out, _ = await orka(c, "exec", "-i", name, "--", "cat", stdin=b"hello\nworld\n")
        assert (code, out) == (0, b"hello\nworld\n")
        code, out, _ = await orka(c, "exec", "-t", name, "--", "sh", "-c", "test -t 1 && echo tty")
        assert (code, out) == (0, b"tty\r\n")
        code, _, err = await orka(c, "exec", name, "--", "/no/such/thing")
        assert code != 0 and err

        # A bad first message is INVALID_ARGUMENT naming the field.
        with pytest.raises(grpc.aio.AioRpcError) as bad:

            async def no_command():  # type: ignore[no-untyped-def]
                yield pb.ExecInstanceRequest(start=pb.ExecStart(instance=name))

            async for _ in c.api.ExecInstance(no_command()):
                pass
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start.command" in (bad.value.details() or "")
    finally:
        await c.stop()
