"""Baseline: a raw grpc.aio bidirectional echo over the same mutual TLS, on this machine, now.

The server is its own OS process (like the scheduler) holding the scheduler's certificate; the
client presents an agent certificate, with the same credentials code and channel options Orka
uses. Each message is a serialized heartbeat with 10 instance statuses, so its size matches
what the agents send. Several streams run at once, each keeping a window of messages in flight;
messages/s counts echoes received. Every other figure is reported as a ratio to this one.

    .venv/bin/python bench/bench_echo.py [--seconds 5] [--streams 8] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.common import PYTHON, certs_dir, emit, free_port, percentile, table, wait_port
from orka.api import agent_pb2 as apb
from orka.api import controller_pb2 as pb
from orka.rpc.server import grpc_options
from orka.security.tls import TlsFiles, channel_credentials, server_credentials

METHOD = "/bench.Echo/Echo"


def payload() -> bytes:
    hb = apb.Heartbeat(usage=pb.Resources(cpu_millis=1200, memory_bytes=1 << 30), sent_at=1.0)
    for i in range(10):
        hb.instances.append(
            apb.InstanceStatus(
                name=f"wl-{i}-abcdef",
                workload=f"wl-{i}",
                phase=pb.Instance.RUNNING,
                started_at=1.0,
                resources=pb.Resources(cpu_millis=100, memory_bytes=64 << 20),
            )
        )
    return apb.AgentMessage(heartbeat=hb).SerializeToString()


async def serve(certs: Path, port: int) -> None:
    async def echo(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for msg in requests:
            yield msg

    server = grpc.aio.server(options=grpc_options())
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    tls = TlsFiles.for_service(certs, "scheduler", "scheduler")
    server.add_secure_port(f"127.0.0.1:{port}", server_credentials(tls))
    await server.start()
    await server.wait_for_termination()


async def client(
    certs: Path, port: int, seconds: float, streams: int, window: int
) -> dict[str, float]:
    tls = TlsFiles.for_service(certs, "agent", "node-00000")
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{port}", channel_credentials(tls), options=grpc_options()
    )
    await channel.channel_ready()
    data = payload()
    received = 0
    rtts: list[float] = []
    stop_at = 0.0

    async def one() -> None:
        nonlocal received
        call = channel.stream_stream(METHOD)()
        sent: list[float] = []
        # Keep `window` messages in flight: throughput, not just one round trip.
        credit = asyncio.Semaphore(window)

        async def writer() -> None:
            while time.monotonic() < stop_at:
                await credit.acquire()
                sent.append(time.perf_counter())
                await call.write(data)
            await call.done_writing()

        w = asyncio.create_task(writer())
        done = 0
        async for _ in call:
            rtts.append(time.perf_counter() - sent[done])
            done += 1
            received += 1
            credit.release()
        await w

    # Warm-up: the TLS handshake and the first stream are not what we measure.
    stop_at = time.monotonic() + 0.5
    await one()
    received, rtts[:] = 0, []
    single: list[float] = []
    call = channel.stream_stream(METHOD)()
    for _ in range(200):
        t = time.perf_counter()
        await call.write(data)
        await call.read()
        single.append(time.perf_counter() - t)
    await call.done_writing()
    start = time.monotonic()
    stop_at = start + seconds
    await asyncio.gather(*(one() for _ in range(streams)))
    elapsed = time.monotonic() - start
    await channel.close()
    return {
        "messages_per_s": round(received / elapsed, 1),
        "rtt_ms_p50": round(percentile(single, 50) * 1e3, 3),
        "rtt_ms_p99": round(percentile(single, 99) * 1e3, 3),
        "payload_bytes": len(data),
        "streams": streams,
    }


def run(seconds: float, streams: int, window: int) -> dict[str, float]:
    certs = certs_dir(1)
    port = free_port()
    server = subprocess.Popen([PYTHON, __file__, "--serve", str(port)])
    try:
        wait_port(port, server)
        return asyncio.run(client(certs, port, seconds, streams, window))
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve(certs_dir(1), args.serve))
        return
    if args.smoke:
        args.seconds = 1.0
    figures = run(args.seconds, args.streams, args.window)
    table(
        "baseline: raw grpc.aio bidi echo over mutual TLS (server in its own process)",
        [
            ("messages/s", figures["messages_per_s"]),
            ("round trip p50 (ms, 1 in flight)", figures["rtt_ms_p50"]),
            ("round trip p99 (ms, 1 in flight)", figures["rtt_ms_p99"]),
            ("payload bytes", figures["payload_bytes"]),
            ("streams", figures["streams"]),
        ],
    )
    emit({"bench": "echo", **figures})


if __name__ == "__main__":
    main()
