"""Run many simulated agents in one OS process: the real Agent, the fake driver, one loop.

Each agent has its own certificate and its own channel to the scheduler. Talks to the
benchmark that started it over stdin/stdout, one JSON object per line:
  -> {"ready": N, "seconds": S}   once every agent has registered
  <- stats                         -> {"heartbeats": N, "registrations": N, "connected": N,
                                        "instances": N}
  <- quit                          -> {"stopped": N}   after stopping every agent (no leave)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import node_name
from orka import gctune, log
from orka.agent.service import Agent, AgentConfig
from orka.agent.stream import Stream
from orka.api import agent_pb2 as apb
from orka.security.tls import TlsFiles


class CountingStream(Stream):
    """The real agent stream; only counts the heartbeats it builds (alone or in a frame) and
    its registrations (each one a scheduler acknowledged)."""

    heartbeats = 0
    registrations = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        connected = self.targets.connected

        def registered() -> None:  # called once per registration a scheduler acknowledged
            CountingStream.registrations += 1
            connected()

        self.targets.connected = registered  # type: ignore[method-assign]

    def heartbeat_message(self) -> apb.AgentMessage:
        CountingStream.heartbeats += 1
        return super().heartbeat_message()


class CountingAgent(Agent):
    stream_class = CountingStream


def say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    certs = Path(args.certs)
    labels = dict(p.split("=", 1) for p in args.labels.split(",") if p) if args.labels else {}
    agents: list[CountingAgent] = []
    start = time.perf_counter()
    for i in range(args.first, args.first + args.count):
        name = node_name(i)
        config = AgentConfig(
            name=name,
            schedulers=args.scheduler.split(","),
            data_dir=Path(args.data_dir) / name,
            runtimes=["fake"],
            cpu_millis=args.cpu_millis,
            memory_bytes=args.memory_bytes,
            labels=labels,
        )
        agents.append(CountingAgent(config, TlsFiles.for_service(certs, "agent", name)))
    # Start in small waves so thousands of TLS handshakes do not all time out at once.
    wave = 50
    for lo in range(0, len(agents), wave):
        chunk = agents[lo : lo + wave]
        await asyncio.gather(*(a.start() for a in chunk))
        await asyncio.gather(*(a.connected.wait() for a in chunk))
    say({"ready": len(agents), "seconds": round(time.perf_counter() - start, 2)})

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if line == "stats":
            say(
                {
                    "heartbeats": CountingStream.heartbeats,
                    "registrations": CountingStream.registrations,
                    "connected": sum(a.connected.is_set() for a in agents),
                    "instances": sum(len(a.instances) for a in agents),
                }
            )
        elif line in ("quit", ""):
            await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)
            say({"stopped": len(agents)})
            return


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--certs", required=True)
    p.add_argument("--scheduler", required=True)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--cpu-millis", type=int, default=16000)
    p.add_argument("--memory-bytes", type=int, default=64 << 30)
    p.add_argument("--labels", default="")
    # Structured logs go to stderr; stdout is the line protocol above.
    log.configure(
        level=os.environ.get("ORKA_BENCH_AGENT_LOG_LEVEL", "warning"), service="bench-agents"
    )
    gctune.tune()  # as `orka agent` does
    asyncio.run(main(p.parse_args()))
