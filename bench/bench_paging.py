"""Paging a big instance list, in process: the controller's ListInstances handler over a repo
of 10,000 instances (100 workloads of 100), page after page with the default size until the
last page, each page serialized as gRPC would send it. No network: this is the controller's
own cost per listing (the index walk, the conversion, the encoding).

    .venv/bin/python bench/bench_paging.py [--instances 10000] [--repeat 5] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, table
from orka.api import controller_pb2 as pb
from orka.controller.api import ControllerApi
from orka.controller.events import EventHub
from orka.controller.repo import Change, Repo
from orka.models import Instance
from orka.security.identity import Identity
from orka.store.memory import MemoryStore

LIST = inspect.unwrap(ControllerApi.ListInstances)


async def fill(repo: Repo, count: int, per_workload: int = 100) -> None:
    instances = [
        Instance(name=f"w{i // per_workload:03d}-{i:06x}", workload=f"w{i // per_workload:03d}")
        for i in range(count)
    ]
    await repo.mutate(lambda: [Change("instances", i.name, i, create=True) for i in instances])


async def page_through(api: ControllerApi, size: int, **filters: Any) -> tuple[int, int, int]:
    """Pages, objects and bytes of one full listing."""
    who = Identity("admin", "admin")
    token, pages, objects, size_bytes = "", 0, 0, 0
    while True:
        req = pb.ListInstancesRequest(page_size=size, page_token=token, **filters)
        resp = await LIST(api, req, who)
        size_bytes += len(resp.SerializeToString())
        pages += 1
        objects += len(resp.instances)
        token = resp.next_page_token
        if not token:
            return pages, objects, size_bytes


async def measure(count: int, repeat: int) -> dict[str, Any]:
    async with MemoryStore() as store:
        repo = Repo(store)
        await repo.load()
        await fill(repo, count)
        api = ControllerApi(repo, None, None, EventHub(lambda: repo.revision))  # type: ignore[arg-type]
        rows: dict[str, Any] = {}
        for label, size, filters in (
            ("default size (500)", 0, {}),
            ("page size 1000", 1000, {}),
            ("page size 7", 7, {}),
            ("one workload of 100, size 7", 7, {"workload": f"w{count // 200:03d}"}),
        ):
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                pages, objects, size_bytes = await page_through(api, size, **filters)
                times.append(time.perf_counter() - t0)
            rows[label] = {
                "pages": pages,
                "objects": objects,
                "bytes": size_bytes,
                "median_ms": round(statistics.median(times) * 1000, 1),
                "per_1000_ms": round(statistics.median(times) * 1000 / objects * 1000, 2),
            }
        return {"instances": count, "repeat": repeat, "listings": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="1,000 instances, once")
    args = parser.parse_args()
    if args.smoke:
        args.instances, args.repeat = 1000, 1
    result = asyncio.run(measure(args.instances, args.repeat))
    for label, row in result["listings"].items():
        table(
            f"{label}: {row['objects']:,} instances",
            [
                ("pages", row["pages"]),
                ("bytes", row["bytes"]),
                ("median ms", row["median_ms"]),
                ("ms per 1,000 instances", row["per_1000_ms"]),
            ],
        )
    emit({"bench": "paging", **result})


if __name__ == "__main__":
    main()
