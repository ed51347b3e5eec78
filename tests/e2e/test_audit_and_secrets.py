"""End to end, services as separate OS processes: a secret applied with `orka apply` reaches
the workload's environment and nothing else (no service log, no CLI output, no audit record);
the writes are in the audit file named by ORKA_AUDIT_LOG; data files are owner-only."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.e2e.procs import ProcessCluster, host_copies, kill_host_copies, nodes_ready
from tests.e2e.procs import run_orka as orka
from tests.integration.cluster import eventually

pytestmark = pytest.mark.e2e

WORKLOAD = "e2e-secret"
NODE = "node-1"
SECRET = f"pw-{uuid.uuid4().hex}"


@pytest.fixture
async def cluster(
    certs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ProcessCluster]:
    # Through the environment, as compose or systemd would set it (the flag is --audit-log).
    monkeypatch.setenv("ORKA_AUDIT_LOG", str(tmp_path / "audit" / "audit.jsonl"))
    c = ProcessCluster(certs_dir, tmp_path / "data")
    c.data.mkdir()
    c.start_scheduler()
    c.start_controller()
    c.start_agent(NODE)
    await c.connect()
    try:
        await eventually(lambda: nodes_ready(c, [NODE]), timeout=30)
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        await c.close()
        kill_host_copies(WORKLOAD)


def mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


async def test_a_secret_reaches_the_process_only_and_writes_are_audited(
    cluster: ProcessCluster, tmp_path: Path
) -> None:
    manifest = tmp_path / "db.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "name": WORKLOAD,
                "kind": "process",
                "command": ["sh", "-c", 'echo "started $MODE"; exec sleep 300'],
                "env": {"MODE": "e2e"},
                "secretEnv": {"DB_PASSWORD": SECRET},
                "resources": {"cpu": "10m", "memory": "16Mi"},
            }
        )
    )
    assert "created" in await orka(cluster, "apply", "-f", str(manifest))
    [inst] = await eventually(lambda: cluster.running(WORKLOAD), timeout=30)

    # The process has it in its environment.
    copies = await eventually(lambda: asyncio.to_thread(host_copies, WORKLOAD), timeout=10)
    environ = psutil.Process(copies[inst.name]).environ()
    assert environ["DB_PASSWORD"] == SECRET and environ["MODE"] == "e2e"

    # No reader sees it: get -o json / yaml, describe.
    as_json = json.loads(await orka(cluster, "get", "workload", WORKLOAD, "-o", "json"))
    assert as_json["spec"]["secret_env"] == {"DB_PASSWORD": "<redacted>"}
    assert (as_json["created_by"], as_json["updated_by"]) == ("admin/admin", "admin/admin")
    [listed] = yaml.safe_load(await orka(cluster, "get", "workloads", "-o", "yaml"))
    assert listed["spec"]["secret_env"] == {"DB_PASSWORD": "<redacted>"}
    described = await orka(cluster, "describe", "workload", WORKLOAD)
    assert "Secret env:     DB_PASSWORD" in described
    assert "Created by:     admin/admin" in described

    # What the instance prints is for the service user only.
    instance_dir = cluster.data / "agents" / NODE / "runtime" / "process" / "instances" / inst.name
    assert (instance_dir / "stdout.log").read_text() == "started e2e\n"
    assert [mode(instance_dir / n) for n in ("stdout.log", "stderr.log")] == [0o600, 0o600]

    # Re-applying the file (the CLI cannot compare a secret it is not shown) changes nothing.
    assert await orka(cluster, "apply", "-f", str(manifest)) == f"workload/{WORKLOAD} unchanged\n"
    assert (await cluster.running(WORKLOAD))[0].name == inst.name
    await orka(cluster, "delete", "workload", WORKLOAD)

    # The writes are in the audit file, by admin/admin: create, update (the re-apply), delete.
    audit = tmp_path / "audit" / "audit.jsonl"

    async def audited() -> list[dict[str, object]] | None:
        lines = (await asyncio.to_thread(audit.read_text)).splitlines()
        return [json.loads(x) for x in lines] if len(lines) >= 3 else None

    records = await eventually(audited, timeout=10)
    assert [(r["method"], r["object"], r["outcome"]["code"]) for r in records] == [  # type: ignore[index]
        ("CreateWorkload", {"kind": "workload", "name": WORKLOAD}, "OK"),
        ("UpdateWorkload", {"kind": "workload", "name": WORKLOAD}, "OK"),
        ("DeleteWorkload", {"kind": "workload", "name": WORKLOAD}, "OK"),
    ]
    assert {r["caller"]["identity"] for r in records} == {"admin/admin"}  # type: ignore[index]
    assert mode(audit) == 0o600

    # The secret is in no service's log and in no audit record.
    for path in [*(s.log for s in cluster.services.values()), audit]:
        assert SECRET not in path.read_text(errors="replace"), path
    # The records went through structlog as well (the controller logs JSON lines to a file).
    logged = []
    for line in (cluster.data / "controller.log").read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("logger") == "orka.audit":
                logged.append((entry["method"], entry["caller"]["identity"]))
    assert logged == [
        ("CreateWorkload", "admin/admin"),
        ("UpdateWorkload", "admin/admin"),
        ("DeleteWorkload", "admin/admin"),
    ]

    # Data files holding it are for the service user only.
    controller_dir = cluster.data / "controller"
    agent_dir = cluster.data / "agents" / NODE
    assert mode(controller_dir) == 0o700
    assert mode(controller_dir / "orka.db") == 0o600
    for suffix in ("-wal", "-shm"):
        extra = controller_dir / f"orka.db{suffix}"
        if extra.exists():
            assert mode(extra) == 0o600, extra
    # Traversable only: workloads reach their work dirs, list and read nothing else.
    assert mode(agent_dir) == 0o711
    assert mode(agent_dir / "agent-state.json") == 0o600
