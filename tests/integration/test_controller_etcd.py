"""The in-process cluster with its controller on a real etcd instead of SQLite."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog

from orka.api import controller_pb2 as pb
from orka.store import EtcdStore
from tests.etcd import EtcdCluster, needs_etcd
from tests.integration.cluster import Cluster, eventually

pytestmark = needs_etcd

log = structlog.get_logger("tests.controller_etcd")

FAST = {"heartbeat_interval": 0.2, "node_lost_after": 1.0, "offer_timeout": 0.5}


def spec(name: str, replicas: int) -> pb.WorkloadSpec:
    return pb.WorkloadSpec(
        name=name, kind=pb.WorkloadSpec.PROCESS, command=["sleep", "1000"], replicas=replicas
    )


@pytest.fixture
def store_url(etcd: EtcdCluster, etcd_prefix: str) -> str:
    return etcd.url + etcd_prefix


@pytest.fixture
async def cluster(certs_dir: Path, tmp_path: Path, store_url: str) -> AsyncIterator[Cluster]:
    c = Cluster(certs_dir, tmp_path, **FAST)
    await c.start(agents=3, store_url=store_url, runtimes=["fake"])
    yield c
    await c.stop()


async def running(c: Cluster, workload: str, count: int) -> list[tuple[str, str]] | None:
    found = sorted((i.name, i.node) for i in await c.running(workload))
    return found if len(found) == count else None


async def test_controller_on_etcd_places_and_survives_a_restart(
    cluster: Cluster, store_url: str, etcd: EtcdCluster, etcd_prefix: str
) -> None:
    assert cluster.api is not None and cluster.controller is not None
    assert isinstance(cluster.controller.store, EtcdStore)
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("web", 3)))
    before = await eventually(lambda: running(cluster, "web", 3))

    # The truth is in etcd under the url's prefix, in the documented layout.
    async with EtcdStore(etcd.endpoints, etcd_prefix) as store:
        assert [i.name for i in await store.list("workloads")] == ["web"]
        assert sorted(i.name for i in await store.list("instances")) == [n for n, _ in before]

    await cluster.controller.stop()
    await cluster.start_controller(store_url)
    assert await running(cluster, "web", 3) == before
    await cluster.api.UpdateWorkload(pb.UpdateWorkloadRequest(spec=spec("web", 4)))
    after = await eventually(lambda: running(cluster, "web", 4))
    assert set(before) < set(after)


@pytest.mark.parametrize("n", [10, 100])
async def test_etcd_writes_per_placement(cluster: Cluster, n: int) -> None:
    """Not a timed assertion: prints the figure (run with -s) and checks a loose bound."""
    assert cluster.api is not None and cluster.controller is not None
    store = cluster.controller.store
    assert isinstance(store, EtcdStore)
    txns0, failed0, keys0 = store.txn_count, store.txn_failed, store.keys_written
    started = time.monotonic()
    await cluster.api.CreateWorkload(pb.CreateWorkloadRequest(spec=spec("bulk", n)))
    await eventually(lambda: running(cluster, "bulk", n), timeout=60)
    took = time.monotonic() - started
    txns, failed = store.txn_count - txns0, store.txn_failed - failed0
    keys = store.keys_written - keys0
    figure = (
        f"etcd txns for placing {n} instances to RUNNING: {txns} "
        f"({txns / n:.2f} per instance, {failed} failed CAS), "
        f"{keys} keys written ({keys / n:.2f} per instance), {took:.2f}s"
    )
    print(figure)
    log.info(
        "etcd writes per placement", instances=n, txns=txns, keys=keys, failed=failed, seconds=took
    )
    assert failed == 0
    # Each instance moves through a handful of states; far more than that means a write storm.
    assert txns <= 6 * n, figure
