"""Run the real `orka` CLI (a separate process) against an in-process Cluster."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.integration.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]


def orka_cmd(c: Cluster, *args: str) -> list[str]:
    assert c.controller is not None
    flags = ["--controller", f"127.0.0.1:{c.controller.port}", "--certs", str(c.certs)]
    if "--" in args:
        at = args.index("--")
        return [sys.executable, "-m", "orka.cli.main", *args[:at], *flags, *args[at:]]
    return [sys.executable, "-m", "orka.cli.main", *args, *flags]


def orka_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


async def orka(c: Cluster, *args: str, stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        *orka_cmd(c, *args),
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=orka_env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 30)
    assert proc.returncode is not None
    return proc.returncode, out, err
