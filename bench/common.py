"""Shared plumbing for the benchmarks: certificates, service processes, agent hosts, reporting.

Every benchmark runs the controller and the scheduler as their own OS processes (through the
real `orka` command line) and simulated agents as the real `orka.agent.service.Agent` with the
fake driver, many per OS process (see `agent_host.py`), each with its own connection and its
own certificate.
"""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Runnable as plain scripts from a checkout, without installing the package.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from orka.security.ca import cert_pem, issue_leaf, key_pem  # noqa: E402
from orka.security.issue import cert_stem, init_certs, load_ca  # noqa: E402

PYTHON = sys.executable


def compiled() -> None:
    """Byte-compile the checkout's `orka` package, as an install does: every service process
    would otherwise compile its sources again at each start where PYTHONDONTWRITEBYTECODE is
    set (this host), and a restart's figures would time the compiler (a restarted scheduler:
    0.51 s of CPU to listen, 0.40 s byte-compiled)."""
    compileall.compile_dir(ROOT / "orka", quiet=2)


CACHE = Path(os.environ.get("ORKA_BENCH_CACHE", Path.home() / ".cache" / "orka-bench"))
# Agents keep a state file that they fsync; on tmpfs that costs what it would on a real node's
# local disk at most, instead of this machine's shared virtual disk.
SCRATCH_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def agents_nice() -> int:
    """The nice level of simulated agents, from ORKA_BENCH_AGENTS_NICE (default 10)."""
    text = os.environ.get("ORKA_BENCH_AGENTS_NICE", "10")
    try:
        value = int(text)
    except ValueError:
        raise SystemExit(f"ORKA_BENCH_AGENTS_NICE: not a whole number: {text!r}") from None
    if not 0 <= value <= 19:
        raise SystemExit(f"ORKA_BENCH_AGENTS_NICE: must be 0-19, got {value}")
    return value


# Simulated agents stand for machines of their own: in a cluster their CPU is not the one the
# scheduler and the controller run on. Here they share the host's cores with those services,
# so their processes run at this nice level and the services are served first, as they would
# be with the agents elsewhere; the agents still get every cycle the services leave, and an
# agent that could not keep up would show as a node leaving READY, which the benchmarks count.
# 0 shares the cores evenly (ORKA_BENCH_AGENTS_NICE=0, or run_all.py --agents-nice 0).
AGENTS_NICE = agents_nice()


def node_name(i: int) -> str:
    return f"node-{i:05d}"


# ---- certificates ----


def certs_dir(nodes: int) -> Path:
    """A certs dir with the CA, the service certs and one agent cert per node, cached.

    Issuing is fast (ECDSA P-256), but thousands of files are worth keeping between runs; the
    dir only ever grows, so the 5,000-node run's dir also serves the smaller benchmarks.
    """
    # v2: server certs carry their role name (scheduler.orka) and agent certs are client-only;
    # a cache from before would not let the services start.
    path = CACHE / "certs-v2"
    stamp = path / "agents.count"
    have = int(stamp.read_text()) if stamp.is_file() else 0
    if have >= nodes:
        return path
    start = time.perf_counter()
    init_certs(path)
    ca = load_ca(path)
    for i in range(have, nodes):
        stem = cert_stem("agent", node_name(i))
        leaf = issue_leaf(ca, "agent", node_name(i), ())
        # No fsync per file (unlike `orka certs`): a cache lost in a crash is simply rebuilt.
        key_path = path / f"{stem}.key"
        key_path.write_bytes(key_pem(leaf.key))
        key_path.chmod(0o600)
        (path / f"{stem}.crt").write_bytes(cert_pem(leaf.cert))
    stamp.write_text(str(nodes))
    took = time.perf_counter() - start
    print(f"# issued {nodes - have} agent certificates in {took:.1f}s (cached in {path})")
    return path


# ---- processes ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open within {timeout}s")


@dataclass
class Services:
    """A scheduler and a controller, each its own `orka` process."""

    certs: Path
    work: Path
    scheduler_args: Sequence[str] = ()
    store: str = ""
    scheduler_port: int = 0
    controller_port: int = 0
    # Standby schedulers' addresses, given to the controller after the first one.
    more_schedulers: Sequence[str] = ()
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self) -> Services:
        try:
            return self._start()
        except BaseException:
            self.stop()  # a controller that failed to start must not leave the scheduler behind
            raise

    def _start(self) -> Services:
        compiled()
        self.scheduler_port = free_port()
        self.controller_port = free_port()
        common = [
            "--certs",
            str(self.certs),
            "--log-level",
            os.environ.get("ORKA_BENCH_LOG_LEVEL", "warning"),
        ]
        self._spawn(
            "scheduler",
            [
                "scheduler",
                "--listen",
                f"127.0.0.1:{self.scheduler_port}",
                "--data-dir",
                str(self.work / "scheduler"),
                *common,
                *self.scheduler_args,
            ],
        )
        wait_port(self.scheduler_port, self.procs["scheduler"])
        store = ["--store", self.store] if self.store else []
        self._spawn(
            "controller",
            [
                "controller",
                "--listen",
                f"127.0.0.1:{self.controller_port}",
                "--scheduler",
                ",".join([self.scheduler, *self.more_schedulers]),
                "--data-dir",
                str(self.work / "controller"),
                *store,
                *common,
            ],
        )
        wait_port(self.controller_port, self.procs["controller"])
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        # Appended: a service started again (a restart benchmark) logs after its predecessor.
        log = open(self.work / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            [PYTHON, "-m", "orka.cli.main", *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    @property
    def controller(self) -> str:
        return f"127.0.0.1:{self.controller_port}"

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def stop(self) -> None:
        for name in ("controller", "scheduler", *self.procs):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class AgentHost:
    """One OS process running many agents in one event loop (`agent_host.py`)."""

    def __init__(
        self,
        certs: Path,
        scheduler: str,
        first: int,
        count: int,
        work: Path,
        cpu_millis: int = 16000,
        memory_bytes: int = 64 << 30,
        labels: str = "",
    ) -> None:
        self.count = count
        # `nice` execs the interpreter: the process's pid is the agent host's.
        niced = ["nice", "-n", str(AGENTS_NICE)] if AGENTS_NICE else []
        args = [
            *niced,
            PYTHON,
            str(Path(__file__).with_name("agent_host.py")),
            "--certs",
            str(certs),
            "--scheduler",
            scheduler,
            "--first",
            str(first),
            "--count",
            str(count),
            "--data-dir",
            str(work),
            "--cpu-millis",
            str(cpu_millis),
            "--memory-bytes",
            str(memory_bytes),
        ]
        if labels:
            args += ["--labels", labels]
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(work.parent / f"agents-{first}.log", "wb"),
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        result: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            result.append(self.proc.stdout.readline())

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not result or not result[0]:
            raise RuntimeError(f"agent host pid {self.proc.pid} did not answer within {timeout}s")
        return dict(json.loads(result[0]))

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        return self._read(timeout)

    def ask(self, command: str, timeout: float = 30.0) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            return self._read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask("quit", timeout=20)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


def start_agents(
    certs: Path,
    scheduler: str,
    nodes: int,
    work: Path,
    processes: int,
    first: int = 0,
    **opts: Any,
) -> list[AgentHost]:
    """Start `nodes` agents over `processes` OS processes and wait until all are registered."""
    processes = max(1, min(processes, nodes))
    hosts: list[AgentHost] = []
    per = -(-nodes // processes)
    for p in range(processes):
        lo = first + p * per
        count = min(per, first + nodes - lo)
        if count <= 0:
            break
        d = work / f"agents-{lo}"
        d.mkdir(parents=True, exist_ok=True)
        hosts.append(AgentHost(certs, scheduler, lo, count, d, **opts))
    for h in hosts:
        h.wait_ready()
    return hosts


@contextlib.contextmanager
def workdir(name: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"orka-bench-{name}-", dir=SCRATCH_ROOT))
    try:
        yield path
    finally:
        if os.environ.get("ORKA_BENCH_KEEP"):
            print(f"# kept {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def cpu_seconds(proc: psutil.Process) -> float:
    """User and system CPU seconds `proc` has used (0 once it is gone)."""
    with contextlib.suppress(psutil.Error):
        t = proc.cpu_times()
        return float(t.user + t.system)
    return 0.0


def cpu_totals(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """CPU seconds used so far by each named group of processes."""
    return {name: sum(cpu_seconds(p) for p in group) for name, group in procs.items()}


class CpuSampler:
    """CPU share (of one core) and peak RSS of one process over a window."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._cpu0 = 0.0
        self.cpu_share = 0.0
        self.seconds = 0.0

    def _cpu(self) -> float:
        t = self.proc.cpu_times()
        return float(t.user + t.system)

    def __enter__(self) -> CpuSampler:
        self._t0 = time.monotonic()
        self._cpu0 = self._cpu()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(psutil.Error):
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = time.monotonic() - self._t0
        self.cpu_share = (self._cpu() - self._cpu0) / self.seconds
        self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)


# ---- the admin client ----


def admin_channel(certs: Path, target: str) -> Any:
    from orka.rpc.client import secure_channel
    from orka.security.tls import TlsFiles

    return secure_channel(target, TlsFiles.for_service(certs, "admin", "admin"), "controller")


async def wait_nodes_ready(stub: Any, count: int, timeout: float = 120.0) -> None:
    from orka.api import controller_pb2 as pb
    from orka.rpc.pages import list_all

    deadline = time.monotonic() + timeout
    ready = 0
    while time.monotonic() < deadline:
        nodes, _ = await list_all(stub.ListNodes, pb.ListNodesRequest(), "nodes")
        ready = sum(1 for n in nodes if n.state == pb.Node.READY)
        if ready >= count:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"only {ready} of {count} nodes READY at the controller after {timeout}s")


# ---- reporting ----


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    print(f"\n{title}")
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
        print(f"  {key:<{width}}  {value}")


def emit(result: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object for run_all.py to collect."""
    print(json.dumps(result), flush=True)


def last_json(output: str) -> dict[str, Any]:
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return dict(json.loads(line))
    raise ValueError("no JSON line in the output")
