"""secret_env through the real API: readers (Get, List, Watch and every write's answer) see
"<redacted>", never the value, while the spec the agents get carries it; a redacted value
sent back keeps the stored one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from orka.api import controller_pb2 as pb
from orka.models import REDACTED
from tests.integration.cluster import Cluster, eventually

SECRET = "s3cr3t-f00-value"


def spec(replicas: int = 1, **secret_env: str) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name="db",
        kind=pb.WorkloadSpec.PROCESS,
        command=["sleep", "100"],
        env={"MODE": "test"},
        secret_env=secret_env or {"DB_PASSWORD": SECRET},
        replicas=replicas,
        resources=pb.Resources(cpu_millis=10, memory_bytes=1 << 20),
    )


def assert_redacted(w: pb.Workload) -> None:
    assert dict(w.spec.secret_env) == {"DB_PASSWORD": REDACTED}
    assert dict(w.spec.env) == {"MODE": "test"}
    assert SECRET.encode() not in w.SerializeToString()


def stored(cluster: Cluster) -> dict[str, str]:
    assert cluster.controller is not None
    return dict(cluster.controller.repo.workloads["db"].spec.secret_env)


async def test_readers_never_get_the_value(cluster: Cluster) -> None:
    assert cluster.api is not None
    single = cluster.api.WatchEvents(pb.WatchEventsRequest(workload="db"))
    batches = cluster.api.WatchEventBatches(pb.WatchEventsRequest())
    events: list[pb.Event] = []

    async def read_single() -> None:
        async for ev in single:
            events.append(ev)
            if ev.HasField("instance") and ev.instance.phase == pb.Instance.RUNNING:
                return

    async def read_batches() -> None:
        async for batch in batches:
            events.extend(batch.events)
            if any(e.instance.phase == pb.Instance.RUNNING for e in batch.events):
                return

    readers = [asyncio.create_task(read_single()), asyncio.create_task(read_batches())]
    await asyncio.sleep(0.2)  # subscribed before the create
    created = await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec()))
    async with asyncio.timeout(20):
        await asyncio.gather(*readers)
    single.cancel()
    batches.cancel()

    assert_redacted(created)
    assert_redacted(await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="db")))
    [listed] = (await cluster.api.ListWorkloads(pb.ListWorkloadsRequest())).workloads
    assert_redacted(listed)
    workload_events = [e for e in events if e.HasField("workload")]
    assert len({e.workload.spec.name for e in workload_events}) == 1 and workload_events
    for e in events:
        assert SECRET.encode() not in e.SerializeToString()
    for e in workload_events:
        assert_redacted(e.workload)
    # ... while the controller holds the value, for the agents.
    assert stored(cluster) == {"DB_PASSWORD": SECRET}
    deleted = await cluster.api.DeleteWorkload(pb.DeleteWorkloadRequest(name="db"))
    assert_redacted(deleted.workload)


async def test_an_update_sending_redacted_back_keeps_the_secret(cluster: Cluster) -> None:
    assert cluster.api is not None
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec()))
    read = await cluster.api.GetWorkload(pb.GetWorkloadRequest(name="db"))
    # Read, change the replicas, write back: the secret is kept and nothing restarts.
    read.spec.replicas = 2
    updated = await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=read.spec))
    assert_redacted(updated)
    assert stored(cluster) == {"DB_PASSWORD": SECRET}
    assert updated.generation == 1

    # A new value replaces it (and, being a change to what runs, rolls the instances).
    changed = await cluster.api.UpdateWorkload(
        pb.UpdateWorkloadRequest(spec=spec(replicas=2, DB_PASSWORD="n3w-value"))
    )
    assert stored(cluster) == {"DB_PASSWORD": "n3w-value"}
    assert changed.generation == 2


async def test_redacted_with_nothing_stored_is_refused_and_changes_nothing(
    cluster: Cluster,
) -> None:
    assert cluster.api is not None
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(DB_PASSWORD=REDACTED)))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.secret_env: 'DB_PASSWORD' is '<redacted>'" in (info.value.details() or "")
    assert not (await cluster.api.ListWorkloads(pb.ListWorkloadsRequest())).workloads

    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec()))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.api.UpdateWorkload(
            pb.UpdateWorkloadRequest(spec=spec(DB_PASSWORD=REDACTED, API_KEY=REDACTED))
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'API_KEY'" in (info.value.details() or "")
    assert stored(cluster) == {"DB_PASSWORD": SECRET}


async def test_a_secret_value_is_never_echoed_in_an_error(cluster: Cluster) -> None:
    assert cluster.api is not None
    for bad in ({"K": SECRET + "\0"}, {"K": SECRET * 5000}, {"MODE": SECRET}):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec(**bad)))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith("spec")
        assert SECRET not in (info.value.details() or "")


async def test_secret_env_files_are_read_on_the_node_and_never_travel(
    certs_dir: Path, tmp_path: Path
) -> None:
    """Node-1 allows /…/secrets and its process sees the file's content; node-2 allows no
    secret files, so an instance pinned there fails to start, saying why. The value is in no
    answer, no store and no agent state file."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "db").write_text("fr0m-a-file\n")
    c = Cluster(certs_dir, tmp_path / "data")
    try:
        await c.start()
        await c.add_agent("node-1", runtimes=["process"], secret_dirs=[secrets])
        await c.add_agent("node-2", runtimes=["process"], labels={"no": "secrets"})
        assert c.api is not None

        def file_spec(name: str, selector: dict[str, str]) -> pb.WorkloadSpec:
            s = spec()
            s.name = name
            s.secret_env_files["FROM_FILE"] = str(secrets / "db")
            s.command[:] = ["sh", "-c", 'echo "got $FROM_FILE $DB_PASSWORD"; exec sleep 60']
            s.node_selector.update(selector)
            return s

        created = await c.api.CreateWorkload(
            pb.CreateWorkloadRequest(spec=file_spec("db", {"orka.io/node": "node-1"}))
        )
        assert dict(created.spec.secret_env_files) == {"FROM_FILE": str(secrets / "db")}
        await c.api.CreateWorkload(
            pb.CreateWorkloadRequest(spec=file_spec("nofiles", {"no": "secrets"}))
        )
        [inst] = await eventually(lambda: c.running("db"))
        out = (
            c.agents["node-1"].config.data_dir
            / "runtime/process/instances"
            / inst.name
            / "stdout.log"
        )

        async def printed() -> str | None:
            text = await asyncio.to_thread(out.read_text) if out.exists() else ""
            return text or None

        assert await eventually(printed) == f"got fr0m-a-file {SECRET}\n"

        async def refused() -> list[pb.Instance] | None:
            insts = await c.instances("nofiles")
            return insts if insts and insts[0].reason == "StartFailed" else None

        [failed] = await eventually(refused)
        assert failed.node == "node-2"
        assert failed.message.startswith(
            "secret_env_files: this node reads no secret files (its agent has no --secret-dir)"
        )

        got = await c.api.GetWorkload(pb.GetWorkloadRequest(name="db"))
        assert b"fr0m-a-file" not in got.SerializeToString()
        for agent in c.agents.values():
            await agent.state_file.persist()
            state = await asyncio.to_thread(agent.state_file.path.read_text)
            assert "fr0m-a-file" not in state
    finally:
        await c.stop()
