"""One agent's own work per instance: the real Agent (fake driver) fed offers and starts
in-process, its stream's frames serialized but sent nowhere; CPU seconds per instance.

What `bench_agents.py` measures end to end, without the scheduler, the controller and the
network: the agent's admission, runner, supervisor, state file and status events, as the
number of instances on the node grows (real agents hold hundreds each; simulated ones tens).

    .venv/bin/python bench/agent_work.py [--instances 200] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_agents import cli_certs
from bench.common import SCRATCH_ROOT, emit, node_name
from orka import gctune
from orka.agent.service import Agent, AgentConfig
from orka.agent.stream import Stream
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.security.tls import TlsFiles

BATCH = 20


class NoWire:
    """Where the stream writes: each frame serialized (as gRPC would), RUNNING ones noted."""

    def __init__(self) -> None:
        self.frames = 0
        self.running: set[str] = set()
        self.expected = 0
        self.all_running = asyncio.Event()

    async def write(self, msg: apb.AgentMessage) -> None:
        self.frames += 1
        msg.SerializeToString()
        items = msg.batch.messages if msg.WhichOneof("body") == "batch" else [msg]
        for m in items:
            if m.WhichOneof("body") == "instance_status":
                if m.instance_status.phase == pb.Instance.RUNNING:
                    self.running.add(m.instance_status.name)
        if len(self.running) >= self.expected:
            self.all_running.set()
        await asyncio.sleep(0)


WIRE = NoWire()


class LocalStream(Stream):
    async def run(self) -> None:
        outbox: asyncio.Queue[apb.AgentMessage | None] = asyncio.Queue()
        self.outbox = outbox
        self.connected.set()
        await asyncio.gather(self.writer(WIRE, outbox), self._heartbeats())  # type: ignore[arg-type]


class LocalAgent(Agent):
    stream_class = LocalStream


def batch(msgs: list[apb.SchedulerMessage]) -> apb.SchedulerMessage:
    return apb.SchedulerMessage(batch=apb.SchedulerBatch(messages=msgs))


async def main(n: int, profile: bool) -> dict[str, Any]:
    gctune.tune()
    name = node_name(0)
    work = Path(tempfile.mkdtemp(prefix="orka-bench-agent-work-", dir=SCRATCH_ROOT))
    config = AgentConfig(
        name=name,
        schedulers=["127.0.0.1:1"],
        data_dir=work / "agent",
        runtimes=["fake"],
        cpu_millis=1_000_000,
        memory_bytes=1 << 50,
    )
    agent = LocalAgent(config, TlsFiles.for_service(cli_certs(1), "agent", name))
    await agent.start()
    await agent.connected.wait()
    # As bench_agents places them: a different workload's spec for each instance.
    assignments = [
        apb.Assignment(
            instance=f"wl-{i:03d}-{i:08x}",
            generation=1,
            spec=pb.WorkloadSpec(
                name=f"wl-{i:03d}",
                kind=pb.WorkloadSpec.PROCESS,
                command=["sleep", "infinity"],
                replicas=50,
                resources=pb.Resources(cpu_millis=100, memory_bytes=64 << 20),
            ),
        )
        for i in range(n)
    ]
    WIRE.expected = n
    prof = cProfile.Profile() if profile else None
    wall, cpu = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    # Offers, then their starts, BATCH at a time, as the scheduler's frames bring them.
    for lo in range(0, n, BATCH):
        chunk = assignments[lo : lo + BATCH]
        offers = [
            apb.SchedulerMessage(offer=apb.Offer(offer_id=a.instance, assignment=a)) for a in chunk
        ]
        agent._on_message(batch(offers))
        await asyncio.sleep(0.002)
        starts = [
            apb.SchedulerMessage(start=apb.StartInstance(command_id=a.instance, assignment=a))
            for a in chunk
        ]
        agent._on_message(batch(starts))
        await asyncio.sleep(0.002)
    await WIRE.all_running.wait()
    if prof is not None:
        prof.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await agent.stop()
    shutil.rmtree(work, ignore_errors=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {
        "bench": "agent_work",
        "instances": n,
        "frames": WIRE.frames,
        "cpu_s": round(cpu, 3),
        "cpu_ms_per_instance": round(1000 * cpu / n, 3),
        "wall_s": round(wall, 3),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="print a cProfile of the window")
    args = p.parse_args()
    emit(asyncio.run(main(args.instances, args.profile)))
