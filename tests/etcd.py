"""Real etcd servers for tests: one member or a 3-member cluster on free loopback ports.

The binary comes from Debian's `etcd-server` package (scripts/test.sh installs it); tests that
need it are skipped only when it is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orka.cli.parent_death import die_with_parent
from tests.subprocs import reap

ETCD = Path(os.environ.get("ORKA_TEST_ETCD", "/usr/bin/etcd"))

needs_etcd = pytest.mark.skipif(
    not ETCD.exists(), reason=f"{ETCD} missing (install Debian's etcd-server)"
)

# Generous enough for the controller's placement batches (etcd's default is 128 ops per txn).
MAX_TXN_OPS = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdMember:
    name: str
    data_dir: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, initial_cluster: str, state: str = "new") -> None:
        client_url = f"http://{self.endpoint}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir.parent / f"{self.name}.log").open("ab")
        # A test process killed outright (mutmut's timeout, a SIGKILL) runs no teardown: its
        # etcd goes with it rather than beating every 50 ms for the rest of the run. Only from
        # the main thread: the signal comes when the forking thread exits, and a worker
        # thread's may end before the test does.
        prefix = (
            die_with_parent(signal.SIGKILL)
            if threading.current_thread() is threading.main_thread()
            else []
        )
        self.process = subprocess.Popen(
            [
                *prefix,
                str(ETCD),
                "--name",
                self.name,
                "--data-dir",
                str(self.data_dir),
                "--listen-client-urls",
                client_url,
                "--advertise-client-urls",
                client_url,
                "--listen-peer-urls",
                self.peer_url,
                "--initial-advertise-peer-urls",
                self.peer_url,
                "--initial-cluster",
                initial_cluster,
                "--initial-cluster-state",
                state,
                "--initial-cluster-token",
                f"orka-test-{os.getpid()}",
                "--max-txn-ops",
                str(MAX_TXN_OPS),
                # Fast elections so that stopping a member does not stall the test for long.
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
                "--log-level",
                "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def stop(self, kill: bool = False) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        reap(proc, 10, 10)


class EtcdCluster:
    """`size` members on loopback; `endpoints` lists their client addresses."""

    def __init__(self, base: Path, size: int = 1) -> None:
        self.base = base
        self.members = [EtcdMember(f"m{i}", base / f"m{i}") for i in range(size)]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(self.endpoints)

    def start(self, timeout: float = 30.0) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.start(initial)
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members):
            for m in self.members:
                if m.process is not None and m.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"etcd {m.name} exited; see {self.base}/{m.name}.log")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd not healthy within {timeout}s; logs in {self.base}")
            time.sleep(0.1)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.base)
