"""End to end: two `orka apply` runs of different files for one workload never silently
overwrite each other. Controller and scheduler run as processes and each `orka` is a real CLI
process; the race is made deterministic by running the first apply exactly between the second's
read and its write (the second reading with `orka get`, then writing with `--etag`, or, for the
default path that reads and writes in one run, through a seam in the client it uses)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from orka.api import controller_pb2 as pb
from orka.cli.apply import apply_one
from orka.cli.client import AdminClient
from orka.errors import Aborted, AlreadyExists
from orka.models import Workload, WorkloadSpec
from tests.e2e.procs import ProcessCluster
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

NAME = "raced"
REREAD = f"re-read it (orka get workload {NAME}) and apply again"


async def orka(cluster: ProcessCluster, *args: str) -> tuple[int, str, str]:
    """The CLI as a user runs it: exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        *args,
        "--controller",
        f"127.0.0.1:{cluster.controller_port}",
        "--certs",
        str(cluster.certs),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("ORKA_")},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def manifest(path: Path, *command: str) -> Path:
    doc = {"name": NAME, "kind": "process", "command": list(command), "replicas": 0}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path) -> AsyncIterator[ProcessCluster]:
    c = ProcessCluster(certs_dir, tmp_path)
    c.start_scheduler()
    c.start_controller()
    try:
        api = await c.connect()

        async def serving() -> bool:
            try:
                await api.ListWorkloads(pb.ListWorkloadsRequest(), timeout=2)
            except Exception:
                return False
            return True

        await eventually(serving, timeout=30)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()


async def stored_command(cluster: ProcessCluster) -> list[str]:
    api = cluster.api or await cluster.connect()
    w = await api.GetWorkload(pb.GetWorkloadRequest(name=NAME), timeout=10)
    return list(w.spec.command)


async def test_the_second_of_two_applies_fails_and_is_told_to_re_read(
    cluster: ProcessCluster, tmp_path: Path
) -> None:
    first = manifest(tmp_path / "first.yaml", "sleep", "1")
    second = manifest(tmp_path / "second.yaml", "sleep", "2")
    code, out, err = await orka(cluster, "apply", "-f", str(manifest(tmp_path / "base.yaml", "x")))
    assert (code, out.strip()) == (0, f"workload/{NAME} created"), err

    # The second apply reads ...
    code, out, err = await orka(cluster, "get", "workload", NAME, "-o", "json")
    assert code == 0, err
    read = json.loads(out)["etag"]
    # ... the first applies in between ...
    code, out, err = await orka(cluster, "apply", "-f", str(first))
    assert (code, out.strip()) == (0, f"workload/{NAME} configured"), err
    # ... and the second's write, with what it read, fails and changes nothing.
    code, out, err = await orka(cluster, "apply", "-f", str(second), "--etag", read)
    assert code == 1 and out == ""
    assert err.strip() == (
        f"error: workload/{NAME} was changed by someone else since it was read;"
        f" nothing was applied; {REREAD}"
    )
    assert await stored_command(cluster) == ["sleep", "1"]

    # As told: apply again (it reads afresh) and it goes through.
    code, out, err = await orka(cluster, "apply", "-f", str(second))
    assert (code, out.strip()) == (0, f"workload/{NAME} configured"), err
    assert await stored_command(cluster) == ["sleep", "2"]

    # A delete with the etag read before all that is refused the same way, and keeps it.
    code, out, err = await orka(cluster, "delete", "workload", NAME, "--etag", read)
    assert code == 1 and err.strip() == (
        f"error: workload/{NAME} was changed since it was read; nothing was deleted:"
        f" re-read it (orka get workload {NAME}) and try again"
    )
    assert await stored_command(cluster) == ["sleep", "2"]


class Interleaved(AdminClient):
    """A client that runs `between` (the other apply) right after each read of the workload:
    the seam that puts the first apply between the second's read and its write."""

    between: list[tuple[ProcessCluster, Path]]

    async def get_workload(self, name: str) -> Workload:
        try:
            return await super().get_workload(name)
        finally:
            while self.between:
                cluster, path = self.between.pop()
                code, _, err = await orka(cluster, "apply", "-f", str(path))
                assert code == 0, err


def client_for(cluster: ProcessCluster, first: Path) -> Interleaved:
    client = Interleaved(f"127.0.0.1:{cluster.controller_port}", cluster.certs)
    client.between = [(cluster, first)]
    return client


async def test_apply_sends_the_etag_it_read(cluster: ProcessCluster, tmp_path: Path) -> None:
    code, _, err = await orka(cluster, "apply", "-f", str(manifest(tmp_path / "base.yaml", "x")))
    assert code == 0, err
    first = manifest(tmp_path / "first.yaml", "sleep", "1")
    second = WorkloadSpec(name=NAME, kind="PROCESS", command=["sleep", "2"], replicas=0)
    async with client_for(cluster, first) as client:
        with pytest.raises(Aborted) as info:
            await apply_one(client, second)
    assert info.value.message == (
        f"workload/{NAME} was changed by someone else since it was read; nothing was applied;"
        f" {REREAD}"
    )
    assert await stored_command(cluster) == ["sleep", "1"]


async def test_two_creates_racing_the_second_gets_already_exists(
    cluster: ProcessCluster, tmp_path: Path
) -> None:
    first = manifest(tmp_path / "first.yaml", "sleep", "1")
    second = WorkloadSpec(name=NAME, kind="PROCESS", command=["sleep", "2"], replicas=0)
    async with client_for(cluster, first) as client:
        with pytest.raises(AlreadyExists) as info:
            await apply_one(client, second)
    assert info.value.message == (
        f"workload/{NAME} was created by someone else meanwhile; nothing was applied; {REREAD}"
    )
    assert await stored_command(cluster) == ["sleep", "1"]
