"""End to end, the CLI as a user runs it against a controller and scheduler as processes:
`orka certs issue --role viewer --name alice` writes a pair the CLI presents with
`--identity viewer-alice` (or ORKA_IDENTITY); the viewer reads, and its writes are refused
with "permission denied" and change nothing."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.procs import ProcessCluster
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

WORKLOAD = "e2e-identity"


async def orka(
    *args: str, env: dict[str, str] | None = None, cluster: ProcessCluster | None = None
) -> tuple[int, str, str]:
    """The CLI as a user runs it: exit code, stdout, stderr."""
    target = (
        ["--controller", f"127.0.0.1:{cluster.controller_port}", "--certs", str(cluster.certs)]
        if cluster is not None
        else []
    )
    environ = {k: v for k, v in os.environ.items() if k != "ORKA_IDENTITY"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orka.cli.main",
        *args,
        *target,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def manifest(path: Path, replicas: int) -> Path:
    spec = {"name": WORKLOAD, "kind": "process", "command": ["sleep", "600"], "replicas": replicas}
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[ProcessCluster]:
    certs = tmp_path / "certs"
    # Its own CA, made and extended with the CLI (the viewer pair is issued below).
    assert (await orka("certs", "init", "--dir", str(certs)))[0] == 0
    c = ProcessCluster(certs, tmp_path / "data")
    c.data.mkdir()
    c.start_scheduler()
    c.start_controller()
    try:
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()


async def test_a_viewer_identity_reads_and_is_refused_writes(
    cluster: ProcessCluster, tmp_path: Path
) -> None:
    code, out, err = await orka(
        "certs", "issue", "--dir", str(cluster.certs), "--role", "viewer", "--name", "alice"
    )
    assert code == 0, err

    # The admin (the default identity) creates a workload once the controller leads.
    async def applied() -> bool:
        code, out, _ = await orka(
            "apply", "-f", str(manifest(tmp_path / "wl.yaml", 1)), cluster=cluster
        )
        return code == 0 and f"workload/{WORKLOAD} created" in out

    await eventually(applied, timeout=30, interval=0.5)

    # The viewer lists it, by the global flag before the command and by the environment.
    code, out, err = await orka("--identity", "viewer-alice", "get", "workloads", cluster=cluster)
    assert code == 0, err
    assert WORKLOAD in out
    viewer = {"ORKA_IDENTITY": "viewer-alice"}
    code, out, err = await orka("get", "workloads", "-o", "json", cluster=cluster, env=viewer)
    assert code == 0, err
    assert WORKLOAD in out

    # A write is refused, saying so, and stores nothing.
    code, out, err = await orka(
        "apply", "-f", str(manifest(tmp_path / "wl3.yaml", 3)), cluster=cluster, env=viewer
    )
    assert (code, out) == (1, "")
    assert err == ("error: permission denied: role viewer may not call this API; allowed: admin\n")
    code, out, _ = await orka("get", "workload", WORKLOAD, "-o", "yaml", cluster=cluster)
    assert code == 0
    assert yaml.safe_load(out)["spec"]["replicas"] == 1

    # After the command too; an identity with no pair names the command that makes one.
    code, out, err = await orka("get", "workloads", "--identity", "viewer-bob", cluster=cluster)
    assert code == 1
    assert "no certificate for viewer 'bob'" in err
    assert f"orka certs issue --dir {cluster.certs} --role viewer --name bob" in err
    # A malformed name is a usage error, found before anything is dialled.
    code, out, err = await orka("--identity", "nobody", "get", "workloads", cluster=cluster)
    assert code == 2
    assert err.startswith("error: --identity: 'nobody' is not admin or <role>-<name>")
