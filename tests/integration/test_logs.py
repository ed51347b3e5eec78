"""`orka logs` end to end: a real process instance writes, its agent keeps bounded, rotated
files, and the CLI (a real `orka` process) reads them through the controller, the scheduler
and the agent's stream. One scenario walks: follow across rotations, stdout and stderr apart,
--tail, --since, a workload's prefixed lines, the bound on disk, errors, and a cancelled
follow ending the agent's session."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.rpc.client import call
from tests.integration.cluster import Cluster, eventually
from tests.integration.cluster import process_spec as spec
from tests.integration.orka_cli import orka, orka_cmd, orka_env

MAX_BYTES = 16 << 10
PAD = "x" * 100
# ~110-byte lines to stdout and stderr, ~80 a second each: a rotation every two seconds or so.
TALK = (
    f'i=0; while :; do i=$((i+1)); echo "out $i {PAD}"; echo "err $i {PAD}" >&2; sleep 0.01; done'
)
LINE = re.compile(rb"^(\[[\w-]+\] )?(out|err) (\d+) x+$")


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path)
    try:
        await c.start()
        await c.add_agent("node-1", runtimes=["process"], log_max_bytes=MAX_BYTES)
        yield c
    finally:
        await c.stop()


def numbers(text: bytes, kind: bytes) -> list[int]:
    found = []
    for line in text.splitlines():
        m = LINE.match(line)
        assert m is not None, line
        assert m.group(2) == kind, line
        found.append(int(m.group(3)))
    return found


def kept_bytes(out: Path) -> int:
    old = out.with_name(out.name + ".1")
    return sum(p.stat().st_size for p in (out, old) if p.exists())


async def test_logs_follow_tail_since_rotation_and_errors(cluster: Cluster) -> None:
    c = cluster
    assert c.api is not None
    agent = c.agents["node-1"]
    await call(
        c.api.CreateWorkload,
        pb.CreateWorkloadRequest(spec=spec("talker", replicas=1, command=["sh", "-c", TALK])),
    )
    (inst,) = await eventually(lambda: c.running("talker"))
    name = inst.name
    out_path, err_path = agent.instances[name].driver.log_paths(name)

    # Follow: lines arrive as they are written, stdout and stderr apart, in order, across
    # rotations (the copytruncate window may lose a line or two, never more).
    proc = await asyncio.create_subprocess_exec(
        *orka_cmd(c, "logs", "-f", name),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=orka_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    rotated = out_path.with_name("stdout.log.1")
    seen: list[int] = []
    rotations = 0
    inode = 0
    async with asyncio.timeout(30):
        while rotations < 2 or len(seen) < 50:
            line = await proc.stdout.readline()
            seen.extend(numbers(line, b"out"))
            now = rotated.stat().st_ino if rotated.exists() else 0
            if now != inode:
                inode, rotations = now, rotations + 1
            assert kept_bytes(out_path) <= 2 * MAX_BYTES + 20_000
        err_line = await proc.stderr.readline()
    assert numbers(err_line, b"err")
    assert seen == sorted(set(seen))
    missing = seen[-1] - seen[0] + 1 - len(seen)
    assert missing <= 1, f"{missing} lines lost over {rotations} rotations"

    # Ending the client's call ends the session on the agent.
    assert len(agent.sessions) == 1
    proc.kill()
    await proc.wait()
    await eventually(lambda: asyncio.sleep(0, len(agent.sessions) == 0), timeout=10)

    # --tail N: the last N lines of each stream, on its own output.
    code, out, err = await orka(c, "logs", "--tail", "3", name)
    assert code == 0, err
    tail = numbers(out, b"out")
    assert len(tail) == 3 and tail == list(range(tail[0], tail[0] + 3)) and tail[0] > seen[-1]
    assert len(numbers(err, b"err")) == 3

    # Everything kept, and --since: only the last moments.
    code, everything, _ = await orka(c, "logs", name)
    code2, recent, _ = await orka(c, "logs", name, "--since", "1s")
    assert code == code2 == 0
    kept, since = numbers(everything, b"out"), numbers(recent, b"out")
    assert 0 < len(since) < len(kept) and since[0] > kept[0]

    # A workload: each line prefixed with its instance.
    code, out, _ = await orka(c, "logs", "talker", "--tail", "1")
    assert code == 0 and out.startswith(f"[{name}] out ".encode())

    # The bound holds on disk, for both streams.
    for path in (out_path, err_path):
        assert kept_bytes(path) <= 2 * MAX_BYTES + 20_000

    # Exec into the process instance: its environment, its user, its exit code.
    code, out, err = await orka(
        c, "exec", name, "--", "sh", "-c", "echo $ORKA_INSTANCE; id -u; exit 5"
    )
    workload_uid = (out_path.parent.parent.parent / "work" / name).stat().st_uid
    assert (code, out, err) == (5, f"{name}\n{workload_uid}\n".encode(), b"")

    code, out, _ = await orka(c, "exec", "-t", name, "--", "sh", "-c", "test -t 1 && echo tty")
    assert (code, out) == (0, b"tty\r\n")

    # Errors: an unknown name, a bad request through the API.
    code, _, err = await orka(c, "logs", "nope")
    assert code == 1 and b"no instance or workload named 'nope'" in err
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        async for _ in c.api.ReadLogs(pb.ReadLogsRequest(instance=name, tail_lines=-1)):
            pass
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tail_lines" in (bad.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as missing_inst:
        async for _ in c.api.ReadLogs(pb.ReadLogsRequest(instance="ghost-1")):
            pass
    assert missing_inst.value.code() == grpc.StatusCode.NOT_FOUND
