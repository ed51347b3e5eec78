"""How far behind a `orka logs -f` stream runs: a line written with a timestamp -> the moment
the `orka logs -f` process prints it (read from its stdout pipe here).

An in-process cluster (scheduler, controller, one agent with the process driver, real mutual
TLS gRPC); the workload waits until the follow session is open on its agent, then writes N
lines `date +%s.%N` ~10 ms apart. The path measured is the whole one: the file, the agent's
poll (0.1 s), its session, the scheduler relay, the controller, the CLI.

    .venv/bin/python bench/bench_logs.py [--lines 400] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, percentile, table, workdir
from orka.api import controller_pb2 as pb
from orka.rpc.client import call
from orka.security.issue import init_certs
from tests.integration.cluster import Cluster, eventually, process_spec

ROOT = Path(__file__).resolve().parent.parent


async def run(lines: int) -> dict[str, float]:
    with workdir("logs") as tmp:
        certs = tmp / "certs"
        init_certs(certs, nodes=["node-1"])
        c = Cluster(certs, tmp / "data")
        try:
            await c.start()
            agent = await c.add_agent("node-1", runtimes=["process"])
            assert c.api is not None and c.controller is not None
            script = (
                "while [ ! -e go ]; do sleep 0.02; done;"
                f" i=0; while [ $i -lt {lines} ]; do i=$((i+1)); date +%s.%N; sleep 0.01; done;"
                " sleep 1000"
            )
            spec = process_spec("stamp", replicas=1, command=["sh", "-c", script])
            await call(c.api.CreateWorkload, pb.CreateWorkloadRequest(spec=spec))
            (inst,) = await eventually(lambda: c.running("stamp"))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orka.cli.main", "logs", "-f", inst.name,
                "--controller", f"127.0.0.1:{c.controller.port}", "--certs", str(certs),
                stdout=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            assert proc.stdout is not None
            await eventually(lambda: asyncio.sleep(0, len(agent.sessions) == 1))
            work = tmp / "data" / "agents" / "node-1" / "runtime" / "process" / "work" / inst.name
            (work / "go").touch()
            lags: list[float] = []
            async with asyncio.timeout(60 + lines * 0.05):
                while len(lags) < lines:
                    line = await proc.stdout.readline()
                    lags.append(time.time() - float(line))
            proc.kill()
            await proc.wait()
        finally:
            await c.stop()
    ms = [x * 1000 for x in lags]
    return {
        "lines": len(ms),
        "median_ms": statistics.median(ms),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--smoke", action="store_true", help="a quick run (50 lines)")
    args = parser.parse_args()
    result = asyncio.run(run(50 if args.smoke else args.lines))
    table("orka logs -f lag (line written -> printed by the CLI)", list(result.items()))
    emit({"bench": "logs_follow", **result})


if __name__ == "__main__":
    main()
